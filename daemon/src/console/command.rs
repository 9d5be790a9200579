//! The console's commands: the table `help` prints, and the parsing of one `{"cmd": …}` object
//! into a typed [`Command`]. Every refusal names the command and the argument. Never runs a
//! command (the backends do).

use serde_json::{json, Map, Value as Json};
use valem_service::ModelId;

/// One argument of a command, as `help` lists it.
pub struct Arg {
    pub name: &'static str,
    /// `string`, `object`, `array`, `boolean`.
    pub kind: &'static str,
    pub required: bool,
    pub about: &'static str,
}

/// One command, as `help` lists it.
pub struct Spec {
    pub name: &'static str,
    pub args: &'static [Arg],
    /// The REST call of the reference this command maps to (remote mode).
    pub rest: &'static str,
    pub about: &'static str,
}

const fn req(name: &'static str, kind: &'static str, about: &'static str) -> Arg {
    Arg {
        name,
        kind,
        required: true,
        about,
    }
}

const fn opt(name: &'static str, kind: &'static str, about: &'static str) -> Arg {
    Arg {
        name,
        kind,
        required: false,
        about,
    }
}

const ID: Arg = req("id", "string", "the model id");
const PATH: Arg = req(
    "path",
    "string",
    "a canonical address, e.g. \"$.order.total\"",
);
const TRACES: Arg = opt(
    "includeTraces",
    "boolean",
    "include the cycle's derivation and constraint traces (default false)",
);

/// Every command, in the order `help` lists them.
pub const COMMANDS: &[Spec] = &[
    Spec {
        name: "list-models",
        args: &[],
        rest: "GET /models",
        about: "The ids of every model, alphabetical.",
    },
    Spec {
        name: "create-model",
        args: &[req("spec", "object", "a full ModelSpec")],
        rest: "POST /models",
        about: "Validate, compile and register a model; the result is its info.",
    },
    Spec {
        name: "get-spec",
        args: &[ID],
        rest: "GET /models/{id}/spec",
        about: "The model's ModelSpec, verbatim.",
    },
    Spec {
        name: "get-info",
        args: &[ID],
        rest: "GET /models/{id}",
        about: "The model's id, version and section counts.",
    },
    Spec {
        name: "get-state",
        args: &[
            ID,
            opt(
                "at",
                "string",
                "an ISO-8601 instant: the state as of the last commit at or before it",
            ),
        ],
        rest: "GET /models/{id}/state[?at=]",
        about: "The merged state: base values plus derived values.",
    },
    Spec {
        name: "get-field",
        args: &[ID, PATH],
        rest: "GET /models/{id}/state/{path}",
        about: "The merged value at one address.",
    },
    Spec {
        name: "mutate",
        args: &[
            ID,
            req(
                "mutations",
                "object",
                "writes as {\"$.path\": value}, applied in one reactive cycle",
            ),
            TRACES,
        ],
        rest: "POST /models/{id}/mutations",
        about: "One reactive cycle; the result lists mutatedPaths, derivedUpdated, metaUpdated, flaggedConstraints and dispatchedEffects.",
    },
    Spec {
        name: "patch-mutate",
        args: &[
            ID,
            req(
                "patch",
                "array",
                "an RFC 6902 JSON Patch of the base document (JSON Pointer paths)",
            ),
            TRACES,
        ],
        rest: "POST /models/{id}/mutations/patch",
        about: "One reactive cycle from a JSON Patch (insert, remove, reorder array elements).",
    },
    Spec {
        name: "get-history",
        args: &[ID],
        rest: "GET /models/{id}/history",
        about: "Commit times (ISO-8601), oldest first; pass one as get-state `at`.",
    },
    Spec {
        name: "get-schema",
        args: &[ID, PATH],
        rest: "GET /models/{id}/schema/{path}",
        about: "The field's JSON Schema overlaid with its live meta.",
    },
    Spec {
        name: "explain",
        args: &[
            ID,
            req(
                "path",
                "string",
                "traces whose target starts with this address (\"$\" for all)",
            ),
        ],
        rest: "GET /models/{id}/explain/{path}",
        about: "Recent derivation and constraint traces, oldest first.",
    },
    Spec {
        name: "snapshot",
        args: &[ID],
        rest: "POST /models/{id}/snapshot",
        about: "A point-in-time copy of the state; hand it back to restore.",
    },
    Spec {
        name: "restore",
        args: &[
            ID,
            req("snapshot", "object", "a snapshot exactly as `snapshot` returned it"),
        ],
        rest: "POST /models/{id}/restore",
        about: "Roll the state back to a snapshot.",
    },
    Spec {
        name: "evolve-spec",
        args: &[ID, req("evolution", "object", "a SpecEvolution")],
        rest: "POST /models/{id}/spec/evolve",
        about: "Change a live model's spec, keeping its state; the result is the new info.",
    },
    Spec {
        name: "delete-model",
        args: &[ID],
        rest: "DELETE /models/{id}",
        about: "Remove a model and its state.",
    },
    Spec {
        name: "upload-blob",
        args: &[
            req("data", "string", "the content, base64-encoded"),
            req("mediaType", "string", "its media type, e.g. \"image/png\""),
        ],
        rest: "POST /blobs (multipart: file, mediaType)",
        about: "Store binary content; the result is {blobId, bytes, mediaType}.",
    },
    Spec {
        name: "get-blob",
        args: &[req("blobId", "string", "the id upload-blob returned")],
        rest: "GET /blobs/{blobId}",
        about: "A blob as {blobId, bytes, mediaType, data (base64)}.",
    },
    Spec {
        name: "get-model-blob",
        args: &[ID, req("blobId", "string", "the id upload-blob returned")],
        rest: "GET /models/{id}/blobs/{blobId}",
        about: "A blob the model's state references, as get-blob returns it.",
    },
    Spec {
        name: "get-view",
        args: &[
            ID,
            opt(
                "viewId",
                "string",
                "the view to evaluate (default: the defaultView)",
            ),
        ],
        rest: "GET /models/{id}/view[/{viewId}]",
        about: "The view definition evaluated against the current state.",
    },
    Spec {
        name: "help",
        args: &[],
        rest: "-",
        about: "This list.",
    },
    Spec {
        name: "exit",
        args: &[],
        rest: "-",
        about: "Answer and end the console (end of input ends it too).",
    },
];

/// A parsed command.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    ListModels,
    CreateModel {
        spec: Map<String, Json>,
    },
    GetSpec {
        id: ModelId,
    },
    GetInfo {
        id: ModelId,
    },
    GetState {
        id: ModelId,
        at: Option<String>,
    },
    GetField {
        id: ModelId,
        path: String,
    },
    Mutate {
        id: ModelId,
        mutations: Map<String, Json>,
        include_traces: bool,
    },
    PatchMutate {
        id: ModelId,
        patch: Vec<Json>,
        include_traces: bool,
    },
    GetHistory {
        id: ModelId,
    },
    GetSchema {
        id: ModelId,
        path: String,
    },
    Explain {
        id: ModelId,
        path: String,
    },
    Snapshot {
        id: ModelId,
    },
    Restore {
        id: ModelId,
        snapshot: Map<String, Json>,
    },
    EvolveSpec {
        id: ModelId,
        evolution: Map<String, Json>,
    },
    DeleteModel {
        id: ModelId,
    },
    UploadBlob {
        data: String,
        media_type: String,
    },
    GetBlob {
        blob_id: String,
    },
    GetModelBlob {
        id: ModelId,
        blob_id: String,
    },
    GetView {
        id: ModelId,
        view_id: Option<String>,
    },
    Help,
    Exit,
}

/// The arguments of one command line, with the command's name for error messages.
struct Args {
    cmd: &'static str,
    map: Map<String, Json>,
}

use valem_core::spec::kind_of;

impl Args {
    /// The argument, `None` when absent or null.
    fn take(&mut self, name: &str) -> Option<Json> {
        self.map.remove(name).filter(|v| !v.is_null())
    }

    fn missing(&self, name: &str, what: &str) -> String {
        format!("`{}`: missing argument `{name}` ({what})", self.cmd)
    }

    fn wrong(&self, name: &str, what: &str, got: &Json) -> String {
        format!(
            "`{}`: argument `{name}` must be {what}, not {}",
            self.cmd,
            kind_of(got)
        )
    }

    fn opt_string(&mut self, name: &str) -> Result<Option<String>, String> {
        match self.take(name) {
            None => Ok(None),
            Some(Json::String(s)) if !s.is_empty() => Ok(Some(s)),
            Some(Json::String(_)) => Err(format!(
                "`{}`: argument `{name}` must not be empty",
                self.cmd
            )),
            Some(other) => Err(self.wrong(name, "a string", &other)),
        }
    }

    fn string(&mut self, name: &str) -> Result<String, String> {
        self.opt_string(name)?
            .ok_or_else(|| self.missing(name, "a string"))
    }

    fn object(&mut self, name: &str) -> Result<Map<String, Json>, String> {
        match self.take(name) {
            None => Err(self.missing(name, "an object")),
            Some(Json::Object(m)) => Ok(m),
            Some(other) => Err(self.wrong(name, "an object", &other)),
        }
    }

    fn array(&mut self, name: &str) -> Result<Vec<Json>, String> {
        match self.take(name) {
            None => Err(self.missing(name, "an array")),
            Some(Json::Array(a)) => Ok(a),
            Some(other) => Err(self.wrong(name, "an array", &other)),
        }
    }

    fn flag(&mut self, name: &str) -> Result<bool, String> {
        match self.take(name) {
            None => Ok(false),
            Some(Json::Bool(b)) => Ok(b),
            Some(other) => Err(self.wrong(name, "a boolean", &other)),
        }
    }
}

/// Parse one command object.
pub fn parse(line: Json) -> Result<Command, String> {
    let Json::Object(mut map) = line else {
        return Err(format!(
            "a command must be a JSON object {{\"cmd\": \"<command>\", …}}, not {}",
            kind_of(&line)
        ));
    };
    let name = match map.remove("cmd") {
        Some(Json::String(s)) => s,
        Some(other) => {
            return Err(format!(
                "`cmd` must be a string naming the command, not {}",
                kind_of(&other)
            ))
        }
        None => {
            return Err(
                "missing `cmd`: a command is {\"cmd\": \"<command>\", …}; {\"cmd\": \"help\"} lists them"
                    .into(),
            )
        }
    };
    let Some(spec) = COMMANDS.iter().find(|c| c.name == name) else {
        return Err(format!(
            "unknown command `{name}`; {{\"cmd\": \"help\"}} lists the commands"
        ));
    };
    // A typo is reported, not ignored.
    if let Some(extra) = map
        .keys()
        .find(|k| !spec.args.iter().any(|a| a.name == k.as_str()))
    {
        let takes = if spec.args.is_empty() {
            "it takes no arguments".to_string()
        } else {
            format!(
                "it takes {}",
                spec.args
                    .iter()
                    .map(|a| format!("`{}`", a.name))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        return Err(format!(
            "`{}`: unknown argument `{extra}`; {takes}",
            spec.name
        ));
    }
    let mut a = Args {
        cmd: spec.name,
        map,
    };
    let cmd = match spec.name {
        "list-models" => Command::ListModels,
        "create-model" => Command::CreateModel {
            spec: a.object("spec")?,
        },
        "get-spec" => Command::GetSpec {
            id: a.string("id")?.into(),
        },
        "get-info" => Command::GetInfo {
            id: a.string("id")?.into(),
        },
        "get-state" => Command::GetState {
            id: a.string("id")?.into(),
            at: a.opt_string("at")?,
        },
        "get-field" => Command::GetField {
            id: a.string("id")?.into(),
            path: a.string("path")?,
        },
        "mutate" => Command::Mutate {
            id: a.string("id")?.into(),
            mutations: a.object("mutations")?,
            include_traces: a.flag("includeTraces")?,
        },
        "patch-mutate" => Command::PatchMutate {
            id: a.string("id")?.into(),
            patch: a.array("patch")?,
            include_traces: a.flag("includeTraces")?,
        },
        "get-history" => Command::GetHistory {
            id: a.string("id")?.into(),
        },
        "get-schema" => Command::GetSchema {
            id: a.string("id")?.into(),
            path: a.string("path")?,
        },
        "explain" => Command::Explain {
            id: a.string("id")?.into(),
            path: a.string("path")?,
        },
        "snapshot" => Command::Snapshot {
            id: a.string("id")?.into(),
        },
        "restore" => Command::Restore {
            id: a.string("id")?.into(),
            snapshot: a.object("snapshot")?,
        },
        "evolve-spec" => Command::EvolveSpec {
            id: a.string("id")?.into(),
            evolution: a.object("evolution")?,
        },
        "delete-model" => Command::DeleteModel {
            id: a.string("id")?.into(),
        },
        "upload-blob" => {
            let data = a.string("data")?;
            let media_type = a.string("mediaType")?;
            // It travels as a multipart header in remote mode.
            if media_type.chars().any(char::is_control) {
                return Err(
                    "`upload-blob`: argument `mediaType` must not contain control characters"
                        .into(),
                );
            }
            Command::UploadBlob { data, media_type }
        }
        "get-blob" => Command::GetBlob {
            blob_id: a.string("blobId")?,
        },
        "get-model-blob" => Command::GetModelBlob {
            id: a.string("id")?.into(),
            blob_id: a.string("blobId")?,
        },
        "get-view" => Command::GetView {
            id: a.string("id")?.into(),
            view_id: a.opt_string("viewId")?,
        },
        "help" => Command::Help,
        "exit" => Command::Exit,
        other => return Err(format!("unknown command `{other}`")),
    };
    Ok(cmd)
}

/// The `help` result: the protocol, the mode, and every command with its arguments.
pub fn help(mode: &str) -> Json {
    let commands: Vec<Json> = COMMANDS
        .iter()
        .map(|c| {
            let args: Map<String, Json> = c
                .args
                .iter()
                .map(|a| {
                    (
                        a.name.to_string(),
                        json!({"type": a.kind, "required": a.required, "description": a.about}),
                    )
                })
                .collect();
            json!({
                "cmd": c.name,
                "args": args,
                "rest": c.rest,
                "description": c.about,
            })
        })
        .collect();
    json!({
        "protocol": "one JSON object per line on stdin, {\"cmd\": \"<command>\", …arguments}; one line on stdout for each: {\"ok\": true, \"result\": …} or {\"ok\": false, \"error\": \"<message>\"}",
        "mode": mode,
        "commands": commands,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(v: Json) -> Result<Command, String> {
        parse(v)
    }

    #[test]
    fn parses_typed_arguments() {
        assert_eq!(
            p(json!({"cmd": "mutate", "id": "m", "mutations": {"$.a": 1}})),
            Ok(Command::Mutate {
                id: "m".into(),
                mutations: json!({"$.a": 1}).as_object().cloned().unwrap_or_default(),
                include_traces: false
            })
        );
        assert_eq!(
            p(json!({"cmd": "get-view", "id": "m", "viewId": null})),
            Ok(Command::GetView {
                id: "m".into(),
                view_id: None
            })
        );
        assert_eq!(p(json!({"cmd": "exit"})), Ok(Command::Exit));
    }

    #[test]
    fn refusals_name_the_command_and_argument() {
        let e = |v| p(v).err().unwrap_or_default();
        assert_eq!(
            e(json!({"cmd": "get-field", "id": "m"})),
            "`get-field`: missing argument `path` (a string)"
        );
        assert_eq!(
            e(json!({"cmd": "mutate", "id": "m", "mutations": [1]})),
            "`mutate`: argument `mutations` must be an object, not an array"
        );
        assert_eq!(
            e(json!({"cmd": "get-spec", "id": 3})),
            "`get-spec`: argument `id` must be a string, not a number"
        );
        assert_eq!(
            e(json!({"cmd": "get-spec", "idd": "m"})),
            "`get-spec`: unknown argument `idd`; it takes `id`"
        );
        assert!(e(json!({"cmd": "nope"})).contains("unknown command `nope`"));
        assert!(e(json!({"id": "m"})).contains("missing `cmd`"));
        assert!(e(json!([1])).contains("must be a JSON object"));
        assert!(e(json!({"cmd": 1})).contains("`cmd` must be a string"));
        assert!(e(json!({"cmd": "get-spec", "id": ""})).contains("must not be empty"));
    }

    #[test]
    fn help_lists_every_command() {
        let h = help("embedded");
        let cmds = h["commands"].as_array().cloned().unwrap_or_default();
        assert_eq!(cmds.len(), COMMANDS.len());
        let mutate = cmds.iter().find(|c| c["cmd"] == "mutate");
        assert_eq!(
            mutate.map(|m| m["args"]["mutations"]["required"].clone()),
            Some(json!(true))
        );
    }
}
