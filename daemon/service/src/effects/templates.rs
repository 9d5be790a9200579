//! What an effect reads: trigger truthiness, the model input its expressions see, and the
//! `{{…}}` templates of URLs, headers and bodies.

use super::*;

/// The engine's trigger truthiness: booleans as is, numbers ≠ 0 and non-empty strings pass;
/// null, objects and arrays fail.
pub(super) fn trigger_holds(v: &Json) -> bool {
    match v {
        Json::Bool(b) => *b,
        Json::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Json::String(s) => !s.is_empty(),
        _ => false,
    }
}

/// The model's merged document as an evaluation input, and an environment with `$const` and
/// the spec's library bound as the compiler binds them. A library that does not evaluate is a
/// `BadRequest`.
pub(super) fn model_input(
    svc: &ModelService,
    model: &str,
    spec: &ModelSpec,
) -> Result<(JValue, Env), ServiceError> {
    let doc = svc.state(&crate::ModelId::from(model), None).wait()?;
    let mut env = Env {
        now_ms: Some(now().ms()),
        ..Env::default()
    };
    env.vars.push((
        Rc::from("const"),
        json_to_jvalue(&Json::Object(spec.constants.clone())),
    ));
    valem_engine::compile::bind_library(spec, &mut env, &svc.limits().engine.expr).map_err(
        |errs| {
            let e = errs.first();
            ServiceError::BadRequest(
                e.map_or_else(String::new, |e| format!("{}: {}", e.location, e.message)),
            )
        },
    )?;
    Ok((json_to_jvalue(&doc), env))
}

pub(super) fn eval(
    text: &str,
    input: &JValue,
    env: &Env,
    limits: &Limits,
) -> Result<Option<Json>, String> {
    let c = Compiled::compile(text, limits).map_err(|e| format!("`{text}`: {}", e.message))?;
    c.eval(input, env, limits)
        .and_then(|v| v.map(|v| jvalue_to_json(&v, limits)).transpose())
        .map_err(|e| format!("`{text}`: {}", e.message))
}

/// A url or header template with `{ expr }` segments evaluated (in a url, percent-encoded).
pub(super) fn interpolate(
    t: &str,
    input: &JValue,
    env: &Env,
    limits: &Limits,
    in_url: bool,
) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = t;
    while let Some(i) = rest.find('{') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        let j = after
            .find('}')
            .ok_or_else(|| format!("`{t}`: an unclosed `{{`"))?;
        let v = eval(after[..j].trim(), input, env, limits)?;
        let s = match v {
            None | Some(Json::Null) => String::new(),
            Some(Json::String(s)) => s,
            Some(other) => other.to_string(),
        };
        if in_url {
            out.push_str(&valem_core::path_segment(&s));
        } else {
            out.push_str(&s);
        }
        rest = &after[j + 1..];
    }
    out.push_str(rest);
    Ok(out)
}
