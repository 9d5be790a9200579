//! Model-id namespaces of sandbox sessions: a paired session's models are stored as
//! `<namespace>__<id>` (the namespace is `s` and 16 hex digits, minted by the pairing), and a
//! model id that a namespaced model names in its own spec — `template.ref`, an effect's
//! `target.ref` — resolves inside that namespace, so a session's model never reaches a model
//! outside it. Pure functions over ids; never looks a model up.

use serde_json::Value as Json;

/// The separator between a session's namespace and the agent's own model id.
pub const NS_SEP: &str = "__";

/// Hex digits of a namespace after its leading `s`.
const NS_HEX: usize = 16;

/// `ns` has the shape of a session namespace (`s` + 16 lowercase hex digits).
pub fn is_namespace(ns: &str) -> bool {
    ns.strip_prefix('s').is_some_and(|hex| {
        hex.len() == NS_HEX && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

/// The `<namespace>__` prefix of a sandbox session's model id, if it is one.
pub fn session_prefix(model: &str) -> Option<&str> {
    let (ns, _) = model.split_once(NS_SEP)?;
    is_namespace(ns).then(|| &model[..ns.len() + NS_SEP.len()])
}

/// The id a reference made by model `from` names: inside `from`'s session namespace when it
/// has one, else the reference itself.
pub fn resolve(from: &str, reference: &str) -> String {
    match session_prefix(from) {
        Some(p) => format!("{p}{reference}"),
        None => reference.to_string(),
    }
}

/// Every occurrence of `prefix` removed from the strings of `v`, object keys included (a
/// namespace is random hex, so it appears nowhere else).
pub fn strip(v: &mut Json, prefix: &str) {
    match v {
        Json::String(s) if s.contains(prefix) => *s = s.replace(prefix, ""),
        Json::Array(a) => a.iter_mut().for_each(|x| strip(x, prefix)),
        Json::Object(m) => {
            if m.keys().any(|k| k.contains(prefix)) {
                let old = std::mem::take(m);
                for (k, mut x) in old {
                    strip(&mut x, prefix);
                    m.insert(k.replace(prefix, ""), x);
                }
            } else {
                m.values_mut().for_each(|x| strip(x, prefix));
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn references_resolve_inside_the_namespace() {
        let ns = "s0123456789abcdef";
        let own = format!("{ns}__branch");
        assert_eq!(session_prefix(&own), Some("s0123456789abcdef__"));
        assert_eq!(resolve(&own, "base"), format!("{ns}__base"));
        // An id that names another namespace stays inside this one.
        assert_eq!(
            resolve(&own, "sfedcba9876543210__x"),
            format!("{ns}__sfedcba9876543210__x")
        );
        // Not a session's model: references are absolute.
        for plain in [
            "branch",
            "my__model",
            "s0123__x",
            "S0123456789abcdef__x",
            "s0123456789ABCDEF__x",
        ] {
            assert_eq!(session_prefix(plain), None, "{plain}");
            assert_eq!(resolve(plain, "base"), "base");
        }
        let mut v = json!({format!("{ns}__a"): [format!("model `{ns}__a`")]});
        strip(&mut v, &format!("{ns}__"));
        assert_eq!(v, json!({"a": ["model `a`"]}));
    }
}
