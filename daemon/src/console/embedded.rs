//! The embedded backend: commands run on an in-process, in-memory
//! [`ModelService`](valem_service::ModelService) through the same operations as the MCP tools
//! ([`valem_mcp::ops`]), so results and failure messages are the tools' own.

use std::sync::Arc;

use serde_json::{Map, Value as Json};

use super::{Backend, Command};
use valem_mcp::ops;
use valem_mcp::tools::ToolError;
use valem_service::ModelService;

/// Commands against an in-process service.
pub struct Embedded {
    service: Arc<ModelService>,
}

impl Embedded {
    pub fn new(service: Arc<ModelService>) -> Embedded {
        Embedded { service }
    }
}

/// A tool failure as the console's error message: the contract's structured failures (schema
/// violation, constraint violation, version conflict) as their compact JSON text.
pub fn error_text(e: ToolError) -> String {
    match e {
        ToolError::Structured(v) => v.to_string(),
        ToolError::Message(m) => m,
    }
}

impl Backend for Embedded {
    fn mode(&self) -> String {
        "embedded".into()
    }

    fn execute(&mut self, cmd: &Command) -> Result<Json, String> {
        let s = &*self.service;
        let outcome = match cmd {
            Command::ListModels => ops::list_models(s),
            Command::CreateModel { spec } => ops::create_model(s, spec.clone()),
            Command::GetSpec { id } => ops::model_spec(s, id),
            Command::GetInfo { id } => ops::model_info(s, id),
            Command::GetState { id, at } => ops::state(s, id, at.as_deref(), None, None),
            Command::GetField { id, path } => ops::field(s, id, path),
            Command::Mutate {
                id,
                mutations,
                include_traces,
            } => ops::mutate(s, id, mutations, *include_traces, None).wait(),
            Command::PatchMutate {
                id,
                patch,
                include_traces,
            } => ops::patch(s, id, Json::Array(patch.clone()), *include_traces, None)
                .and_then(|c| c.wait()),
            Command::GetHistory { id } => ops::history(s, id),
            Command::GetSchema { id, path } => ops::effective_schema(s, id, path),
            Command::Explain { id, path } => ops::explain(s, id, path, None),
            Command::Snapshot { id } => ops::snapshot(s, id),
            Command::Restore { id, snapshot } => ops::restore(s, id, snapshot.clone()),
            Command::EvolveSpec { id, evolution } => {
                ops::evolve(s, id, &Json::Object(evolution.clone()))
            }
            Command::DeleteModel { id } => ops::delete(s, id),
            Command::UploadBlob { data, media_type } => {
                ops::upload_blob(s, data, Some(media_type.clone()))
            }
            Command::GetBlob { blob_id } => ops::download_blob(s, blob_id, None),
            Command::GetModelBlob { id, blob_id } => ops::download_blob(s, blob_id, Some(id)),
            Command::GetView { id, view_id } => ops::view(s, id, view_id.as_deref()),
            Command::Help | Command::Exit => Ok(Json::Object(Map::new())),
        };
        outcome.map_err(error_text)
    }
}
