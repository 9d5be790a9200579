//! View evaluation: a spec's `viewDefinition` resolved against the merged document and live meta
//! into the evaluated view `get_view` returns. Pure: no I/O.
//!
//! # Output shape
//!
//! The **EvaluatedView** follows the reference's `EvaluatedView` record:
//! `{modelId, viewId, title, layout, columns?, onOpen?, onClose?, components, views}`.
//! `title` is the view's `title`, else its `label`; `layout` defaults to `"vertical"`; `views`
//! (ours) lists every view of the definition as `{id, title}` so a client can navigate.
//!
//! Each **EvaluatedComponent** carries only the fields its type uses (absent fields are omitted,
//! as the reference's `@JsonInclude(NON_NULL)`), using the reference's field names:
//! - every component: `id`, `type`, `visible` (bool), `label` (plain text, verbatim).
//! - value carriers (inputs, `label`, `image`, `link`, `progressBar`/`gauge`, `dataTable`,
//!   `dataChart`/`sparkline`, `statTile`/`metric`, `jsonViewer`, `effectStatus`, `sectionList`,
//!   `sectionItem`, unknown types): `bind` (canonical rendering) and `value` (the merged document
//!   at `bind`, `null` when absent; a `[*]` bind yields the array of matches).
//! - interactive types (inputs, sliders, date range, file upload, unknown types): `enabled`,
//!   `readOnly`, `required` (bools). `button`: `enabled`.
//! - numeric inputs, sliders, `progressBar`/`gauge`: `min`/`max` (component, else `#minimum`/
//!   `#maximum` meta, else schema `minimum`/`maximum`); `step` (component). All inputs: `minLength`,
//!   `maxLength`, `pattern`, `multipleOf` when meta or the schema sets them (our names).
//! - choice types: `options` — the static list, else `optionsExpr` evaluated server-side (ours;
//!   the reference leaves it to the client), else the `#enum` meta or schema `enum` as
//!   `{value, label}`. `optionsExpr`/`optionsUrl`/`optionsPath` are passed through as written.
//! - expression fields under the **`$` rule** (evaluated only when the string contains `$`, else
//!   literal): `text`, `delta`, `caption`, `trend`, `statTile.value` (when no `bind`), and — ours,
//!   matching the built-in renderer — `variant`, `src`, `href`.
//! - boolean dynamics (bool or any JSONata string): `visible`, `enabled`, `readOnly`, `required`,
//!   `collapsed`, `canAdd`, `canRemove`, `showRetry`.
//! - `keyValueList`/`summaryList`: `items: [{label, bind, value, text, format, currency}]`
//!   (`bind` wins over `text`).
//! - `dateRangeField`: `bindFrom`/`bindTo`, `valueFrom`/`valueTo`.
//! - `effectStatus`: `value` (the status), `error` (value at `errorPath`), `showRetry`
//!   (default: the status, or its `status`/`phase`/`state` member, is `"failed"`).
//! - containers: `components` (recursively); `sectionItem` also `bind`/`value`.
//! - a component with an `itemView` whose bind is an array (ours): `rows: [{index, bind,
//!   components}]` — the item view evaluated once per element. Inside it, a bind under the list's
//!   bind with a template index (`$.items[0].qty` or `$.items[*].qty`) is rewritten to the row's
//!   index; expressions see the merged document with `$self` and `$parent` bound to the element.
//! - everything else the catalog lists (`placeholder`, `helperText`, `tooltip`, `format`,
//!   `currency`, `tableColumns`, `pageSize`, `chartType`, `chartX`, `chartSeries`, `menuItems`,
//!   event handlers, …) is passed through unevaluated; unknown types pass every raw field.
//! - defaults filled from the type: `format` (`currencyField` → `currency`, `percentField` →
//!   `percent`, `progressBar`/`gauge` → `percent`, `staticText` → `markdown`), `allowCustom`
//!   (`comboBox`/`tagsField` true), `ratingField` 1–5 step 1, `fromLabel`/`toLabel`,
//!   `addLabel`/`removeLabel`, `spacer.size` 16, trace-panel `limit` 20, `validationSummary`
//!   `variant` `danger`.
//!
//! # Resolution rules
//!
//! `visible`: the component's `visible`, else `#relevant` meta of the bind (absent → true).
//! `readOnly`: the component's `readOnly`, else `#read_only` meta, else (ours) true when the
//! schema marks the bound path or an ancestor `readOnly` or a derivation writes it or an
//! ancestor. `required`: the component's `required`, else `#required` meta (no schema fallback,
//! as the reference). `enabled`: the component's `enabled`, else `!readOnly`.
//!
//! # Errors
//!
//! No definition → `NoView`; unknown view id → `UnknownView`; an expression that does not
//! compile, an unparseable bind or a dangling `itemView` → `Invalid` naming the component. An
//! expression that fails at evaluation sets its field to `null` and adds `errors: [{field,
//! expression, message}]` plus an `error` summary string to the component (`effectStatus` keeps
//! `error` for the effect's own failure message and reports only `errors`).

mod kinds;
mod support;

use kinds::*;
use support::*;

use std::collections::HashMap;
use std::rc::Rc;

use serde_json::{json, Map, Value as Json};

use valem_core::expr::path::{render, Address, PathSeg};
use valem_core::expr::{json_to_jvalue, jvalue_to_json, Compiled, Env, Limits, Value as JValue};
use valem_core::spec::{MetaProp, ModelSpec};
use valem_core::value::Seg;

use super::schema::resolve;

/// Why a view cannot be evaluated.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ViewError {
    #[error("model `{0}` has no viewDefinition")]
    NoView(String),
    #[error("unknown view `{0}`")]
    UnknownView(String),
    #[error("{0}")]
    Invalid(String),
}

/// Evaluate view `view_id` (default: the definition's `defaultView`, else its first view).
/// `meta` is keyed `"$.path#prop"` as `State::meta_json` returns it.
pub fn evaluate_view(
    spec: &ModelSpec,
    merged: &Json,
    meta: &Map<String, Json>,
    view_id: Option<&str>,
    now: crate::Timestamp,
    limits: &Limits,
) -> Result<Json, ViewError> {
    let def = match &spec.view_definition {
        Some(d @ Json::Object(_)) => d,
        _ => return Err(ViewError::NoView(spec.id.clone())),
    };
    let views: &[Json] = match def.get("views") {
        Some(Json::Array(v)) if !v.is_empty() => v,
        _ => return Err(ViewError::NoView(spec.id.clone())),
    };
    let view = match view_id {
        Some(id) => find_view(views, id).ok_or_else(|| ViewError::UnknownView(id.to_string()))?,
        None => def
            .get("defaultView")
            .and_then(Json::as_str)
            .and_then(|d| find_view(views, d))
            .unwrap_or(&views[0]),
    };

    let mut env = Env::default();
    env.vars.push((
        Rc::from("const"),
        json_to_jvalue(&Json::Object(spec.constants.clone())),
    ));
    if let Err(errs) = super::compile::bind_library(spec, &mut env, limits) {
        let msg: Vec<String> = errs
            .iter()
            .map(|e| format!("{}: {}", e.location, e.message))
            .collect();
        return Err(ViewError::Invalid(msg.join("; ")));
    }
    env.now_ms = Some(now.ms());

    let derived = spec
        .derivations
        .iter()
        .filter_map(|d| Address::parse(&d.path).ok())
        .collect();
    let mut ev = Evaluator {
        spec,
        merged,
        input: json_to_jvalue(merged),
        meta,
        limits,
        views,
        derived,
        cache: HashMap::new(),
        envs: vec![env],
        rows: Vec::new(),
        expanding: Vec::new(),
    };

    let view_id_str = view.get("id").and_then(Json::as_str).unwrap_or("");
    ev.expanding.push(view_id_str.to_string());
    let components = ev.components(view.get("components"))?;
    let mut out = Map::new();
    out.insert("modelId".into(), json!(spec.id));
    out.insert("viewId".into(), json!(view_id_str));
    let title = view.get("title").or_else(|| view.get("label"));
    out.insert("title".into(), title.cloned().unwrap_or(Json::Null));
    out.insert(
        "layout".into(),
        view.get("layout").cloned().unwrap_or(json!("vertical")),
    );
    for k in ["columns", "onOpen", "onClose"] {
        copy(view, &mut out, k);
    }
    out.insert("components".into(), Json::Array(components));
    let list: Vec<Json> = views
        .iter()
        .map(|v| {
            json!({"id": v.get("id").cloned().unwrap_or(Json::Null),
                   "title": v.get("title").or_else(|| v.get("label")).cloned().unwrap_or(Json::Null)})
        })
        .collect();
    out.insert("views".into(), Json::Array(list));
    Ok(Json::Object(out))
}

fn find_view<'a>(views: &'a [Json], id: &str) -> Option<&'a Json> {
    views
        .iter()
        .find(|v| v.get("id").and_then(Json::as_str) == Some(id))
}

fn copy(from: &Json, to: &mut Map<String, Json>, key: &str) {
    if let Some(v) = from.get(key) {
        if !v.is_null() {
            to.insert(key.to_string(), v.clone());
        }
    }
}

/// Deepest chain of nested `itemView` expansions.
const MAX_ITEM_DEPTH: usize = 8;

/// One component as `Evaluator::kind_fields` sees it: its identity and what it binds.
struct Comp<'c> {
    id: &'c str,
    ty: &'c str,
    kind: Kind,
    c: &'c Json,
    bind: Option<&'c Address>,
    bind_from: Option<&'c Address>,
    bind_to: Option<&'c Address>,
    value: Option<&'c Json>,
}

struct Evaluator<'a> {
    spec: &'a ModelSpec,
    merged: &'a Json,
    input: JValue,
    meta: &'a Map<String, Json>,
    limits: &'a Limits,
    views: &'a [Json],
    derived: Vec<Address>,
    cache: HashMap<String, Rc<Compiled>>,
    /// Innermost last: the base env, then one per item-view row.
    envs: Vec<Env>,
    /// Enclosing item-view rows: (list address, element index).
    rows: Vec<(Vec<Seg>, usize)>,
    /// View ids being evaluated (recursion guard).
    expanding: Vec<String>,
}

/// One component's evaluation failures: (field, expression, message).
type Failures = Vec<(String, String, String)>;

impl Evaluator<'_> {
    fn components(&mut self, list: Option<&Json>) -> Result<Vec<Json>, ViewError> {
        let Some(Json::Array(items)) = list else {
            return Ok(Vec::new());
        };
        items.iter().map(|c| self.component(c)).collect()
    }

    fn compile(&mut self, id: &str, field: &str, text: &str) -> Result<Rc<Compiled>, ViewError> {
        if let Some(c) = self.cache.get(text) {
            return Ok(c.clone());
        }
        let c = Compiled::compile(text, self.limits).map_err(|e| {
            ViewError::Invalid(format!(
                "component `{id}`: `{field}` expression `{text}` does not compile{}: {}",
                e.at(),
                e.message
            ))
        })?;
        let c = Rc::new(c);
        self.cache.insert(text.to_string(), c.clone());
        Ok(c)
    }

    /// Evaluate `text`: `Ok(Ok(None))` is *undefined*; `Ok(Err(msg))` an evaluation failure.
    fn eval(
        &mut self,
        id: &str,
        field: &str,
        text: &str,
    ) -> Result<Result<Option<Json>, String>, ViewError> {
        let c = self.compile(id, field, text)?;
        let env = self.envs.last().expect("base env");
        let limits = self.limits;
        Ok(c.eval(&self.input, env, limits)
            .and_then(|v| v.as_ref().map(|v| jvalue_to_json(v, limits)).transpose())
            .map_err(|e| e.message))
    }

    /// A boolean dynamic: JSON bool, any string as JSONata, else `fallback`.
    fn dyn_bool(
        &mut self,
        id: &str,
        c: &Json,
        field: &str,
        fallback: bool,
        fails: &mut Failures,
    ) -> Result<Json, ViewError> {
        Ok(match c.get(field) {
            Some(Json::Bool(b)) => Json::Bool(*b),
            Some(Json::String(s)) => match self.eval(id, field, s)? {
                Ok(v) => Json::Bool(v.as_ref().is_some_and(truthy)),
                Err(m) => {
                    fails.push((field.into(), s.clone(), m));
                    Json::Null
                }
            },
            _ => Json::Bool(fallback),
        })
    }

    /// An expression field under the `$` rule: evaluated only when it contains `$`.
    fn dollar(
        &mut self,
        id: &str,
        c: &Json,
        field: &str,
        fails: &mut Failures,
    ) -> Result<Option<Json>, ViewError> {
        match c.get(field) {
            None | Some(Json::Null) => Ok(None),
            Some(Json::String(s)) if s.contains('$') => match self.eval(id, field, s)? {
                Ok(v) => Ok(Some(v.unwrap_or(Json::Null))),
                Err(m) => {
                    fails.push((field.into(), s.clone(), m));
                    Ok(Some(Json::Null))
                }
            },
            Some(other) => Ok(Some(other.clone())),
        }
    }

    /// Like [`Self::dollar`], with a non-string, non-null result rendered as text.
    fn dollar_text(
        &mut self,
        id: &str,
        c: &Json,
        field: &str,
        fails: &mut Failures,
    ) -> Result<Option<Json>, ViewError> {
        Ok(self.dollar(id, c, field, fails)?.map(|v| match v {
            Json::Null | Json::String(_) => v,
            other => Json::String(other.to_string()),
        }))
    }

    /// Parse a bind-like field and rewrite template indices for the enclosing rows.
    fn address(&self, id: &str, field: &str, text: &str) -> Result<Address, ViewError> {
        let mut a = Address::parse(text).map_err(|e| {
            ViewError::Invalid(format!("component `{id}`: `{field}` {}", e.message))
        })?;
        for (list, i) in &self.rows {
            let n = list.len();
            if a.segs.len() > n
                && a.segs[..n].iter().zip(list).all(|(p, s)| seg_eq(p, s))
                && matches!(a.segs[n], PathSeg::Index(_) | PathSeg::Wild)
            {
                a.segs[n] = PathSeg::Index(*i);
            }
        }
        Ok(a)
    }

    fn value_at(&self, a: &Address) -> Json {
        match a.concrete() {
            Some(segs) => lookup(self.merged, &segs).cloned().unwrap_or(Json::Null),
            None => {
                let mut out = Vec::new();
                collect(self.merged, &a.segs, &mut out);
                Json::Array(out)
            }
        }
    }

    fn meta_of(&self, rendered: &str, prop: MetaProp) -> Option<&Json> {
        self.meta
            .get(&format!("{rendered}#{}", prop.key_name()))
            .or_else(|| self.meta.get(&format!("{rendered}#{}", prop.name())))
    }

    fn component(&mut self, c: &Json) -> Result<Json, ViewError> {
        let id = c.get("id").and_then(Json::as_str).unwrap_or("").to_string();
        let ty = c
            .get("type")
            .and_then(Json::as_str)
            .unwrap_or("")
            .to_string();
        let kind = kind_of(&ty);
        let known_input = KNOWN_INPUTS.contains(&ty.as_str());
        let mut fails: Failures = Vec::new();
        let mut out = Map::new();
        out.insert("id".into(), json!(id));
        out.insert("type".into(), json!(ty));
        copy(c, &mut out, "label");

        // The bind: value locator and meta anchor.
        let [bind, bind_from, bind_to] =
            ["bind", "bindFrom", "bindTo"].map(|field| match c.get(field).and_then(Json::as_str) {
                Some(b) => self.address(&id, field, b).map(Some),
                None => Ok(None),
            });
        let (bind, bind_from, bind_to) = (bind?, bind_from?, bind_to?);
        let anchor = bind.clone().or_else(|| bind_from.clone());
        let concrete = anchor.as_ref().and_then(Address::concrete);
        let rendered = concrete.as_deref().map(render);
        let meta_bool = |ev: &Self, prop: MetaProp| -> Option<bool> {
            rendered
                .as_deref()
                .and_then(|r| ev.meta_of(r, prop))
                .and_then(Json::as_bool)
        };

        // visible: explicit, else `#relevant` meta.
        let relevant = meta_bool(self, MetaProp::Relevant).unwrap_or(true);
        let visible = self.dyn_bool(&id, c, "visible", relevant, &mut fails)?;
        out.insert("visible".into(), visible);

        let schema = concrete
            .as_deref()
            .map(|s| schema_at(&self.spec.schema, s))
            .unwrap_or((None, false));

        let interactive = matches!(
            kind,
            Kind::Input | Kind::Slider | Kind::DateRange | Kind::FileUpload
        );
        if interactive {
            let inherited_ro = meta_bool(self, MetaProp::ReadOnly).unwrap_or_else(|| {
                schema.1
                    || anchor
                        .as_ref()
                        .is_some_and(|a| self.derived.iter().any(|d| d.is_prefix_of(a)))
            });
            let ro = self.dyn_bool(&id, c, "readOnly", inherited_ro, &mut fails)?;
            let req_meta = meta_bool(self, MetaProp::Required).unwrap_or(false);
            let req = self.dyn_bool(&id, c, "required", req_meta, &mut fails)?;
            let en_default = !ro.as_bool().unwrap_or(false);
            let en = self.dyn_bool(&id, c, "enabled", en_default, &mut fails)?;
            out.insert("enabled".into(), en);
            out.insert("readOnly".into(), ro);
            out.insert("required".into(), req);
        }
        if kind == Kind::Button {
            let en = self.dyn_bool(&id, c, "enabled", true, &mut fails)?;
            out.insert("enabled".into(), en);
        }

        // bind + value.
        let carries_value = carries_value(kind, &ty);
        let mut value = None;
        if let Some(b) = &bind {
            if carries_value || kind == Kind::TracePanel {
                out.insert("bind".into(), json!(b.to_string()));
            }
            if carries_value {
                let v = self.value_at(b);
                out.insert("value".into(), v.clone());
                value = Some(v);
            }
        }

        for k in passthrough(kind) {
            copy(c, &mut out, k);
        }
        if kind == Kind::Input && !known_input {
            // Unknown type: keep every raw field a custom renderer may read.
            if let Json::Object(m) = c {
                for (k, v) in m {
                    if !RESOLVED.contains(&k.as_str()) && !out.contains_key(k) {
                        out.insert(k.clone(), v.clone());
                    }
                }
            }
        }

        // Type-specific resolution.
        let limit_meta = |ev: &Self, prop: MetaProp, schema_key: &str| -> Option<Json> {
            rendered
                .as_deref()
                .and_then(|r| ev.meta_of(r, prop))
                .cloned()
                .filter(|v| !v.is_null())
                .or_else(|| schema.0.and_then(|n| n.get(schema_key)).cloned())
        };
        let limit = |prop: MetaProp, key: &str| limit_meta(self, prop, key);
        limit_fields(c, &ty, kind, interactive, limit, &mut out);

        // Options for the choice types (and whatever else carries them).
        let choice = matches!(
            ty.as_str(),
            "selectField"
                | "radioField"
                | "multiSelectField"
                | "autocompleteField"
                | "comboBox"
                | "tagsField"
                | "countryRegionSelector"
        );
        if let Some(o) = c.get("options").filter(|o| !o.is_null()) {
            out.insert("options".into(), o.clone());
        } else if let Some(Json::String(expr)) = c.get("optionsExpr") {
            match self.eval(&id, "optionsExpr", expr)? {
                Ok(v) => {
                    out.insert("options".into(), normalize_options(v));
                }
                Err(m) => {
                    fails.push(("options".into(), expr.clone(), m));
                    out.insert("options".into(), Json::Null);
                }
            }
        } else if choice {
            if let Some(Json::Array(vals)) = limit_meta(self, MetaProp::Enum, "enum") {
                out.insert("options".into(), normalize_options(Some(Json::Array(vals))));
            }
        }

        let k = Comp {
            id: &id,
            ty: &ty,
            kind,
            c,
            bind: bind.as_ref(),
            bind_from: bind_from.as_ref(),
            bind_to: bind_to.as_ref(),
            value: value.as_ref(),
        };
        self.kind_fields(&k, &mut out, &mut fails)?;
        if c.get("collapsed").is_some_and(|v| !v.is_null()) {
            let v = self.dyn_bool(&id, c, "collapsed", false, &mut fails)?;
            out.insert("collapsed".into(), v);
        }

        self.children_and_rows(&id, kind, c, (bind.as_ref(), value.as_ref()), &mut out)?;

        report_failures(kind, fails, &mut out);
        Ok(Json::Object(out))
    }

    /// A container's evaluated children, and an item view's rows (one per element of the
    /// bound list).
    fn children_and_rows(
        &mut self,
        id: &str,
        kind: Kind,
        c: &Json,
        (bind, value): (Option<&Address>, Option<&Json>),
        out: &mut Map<String, Json>,
    ) -> Result<(), ViewError> {
        // Children.
        if matches!(kind, Kind::Container | Kind::SectionList) || c.get("components").is_some() {
            if let Some(children) = c.get("components").filter(|v| v.is_array()) {
                let evaluated = self.components(Some(children))?;
                out.insert("components".into(), Json::Array(evaluated));
            } else if kind == Kind::Container {
                out.insert("components".into(), json!([]));
            }
        }

        // Item-view rows.
        if let Some(item_view) = c.get("itemView").and_then(Json::as_str) {
            out.insert("itemView".into(), json!(item_view));
            if let (Some(b), Some(Json::Array(elems))) = (bind, value) {
                if let Some(list) = b.concrete() {
                    let rows = self.rows_for(id, item_view, &list, elems)?;
                    out.insert("rows".into(), Json::Array(rows));
                }
            }
        }
        Ok(())
    }

    /// The fields only some kinds of component have: texts and variants, a tile's figures, an
    /// image's source, a link, a date range's two ends, key-value items, an effect's status, a
    /// section list's buttons.
    fn kind_fields(
        &mut self,
        k: &Comp<'_>,
        out: &mut Map<String, Json>,
        fails: &mut Failures,
    ) -> Result<(), ViewError> {
        match k.kind {
            Kind::Label | Kind::StaticText | Kind::Badge => {
                if let Some(t) = self.dollar_text(k.id, k.c, "text", fails)? {
                    out.insert("text".into(), t);
                }
                if k.kind == Kind::Badge {
                    if let Some(v) = self.dollar_text(k.id, k.c, "variant", fails)? {
                        out.insert("variant".into(), v);
                    }
                }
            }
            Kind::Button | Kind::ValidationSummary => {
                if let Some(v) = self.dollar_text(k.id, k.c, "variant", fails)? {
                    out.insert("variant".into(), v);
                } else if k.kind == Kind::ValidationSummary {
                    out.insert("variant".into(), json!("danger"));
                }
            }
            Kind::StatTile => {
                if k.bind.is_none() {
                    if let Some(v) = self.dollar(k.id, k.c, "value", fails)? {
                        out.insert("value".into(), v);
                    }
                }
                for f in ["delta", "caption", "trend", "variant"] {
                    if let Some(v) = self.dollar_text(k.id, k.c, f, fails)? {
                        out.insert(f.into(), v);
                    }
                }
            }
            Kind::Image => {
                let src = self.dollar(k.id, k.c, "src", fails)?;
                if let Some(s) = src.or_else(|| k.value.cloned()) {
                    out.insert("src".into(), s);
                }
            }
            Kind::Link => {
                let href = self.dollar(k.id, k.c, "href", fails)?;
                let href = href.or_else(|| k.value.cloned());
                let text = self.dollar_text(k.id, k.c, "text", fails)?;
                let text = text
                    .or_else(|| k.c.get("label").cloned())
                    .or_else(|| href.clone());
                if let Some(h) = href {
                    out.insert("href".into(), h);
                }
                if let Some(t) = text {
                    out.insert("text".into(), t);
                }
            }
            Kind::Separator if k.ty == "spacer" => {
                out.entry("size").or_insert(json!(16));
            }
            Kind::TracePanel => {
                out.entry("limit").or_insert(json!(20));
            }
            Kind::DateRange => {
                for (field, vfield, a, dflt) in [
                    ("bindFrom", "valueFrom", &k.bind_from, "From"),
                    ("bindTo", "valueTo", &k.bind_to, "To"),
                ] {
                    if let Some(a) = a {
                        out.insert(field.into(), json!(a.to_string()));
                        out.insert(vfield.into(), self.value_at(a));
                    }
                    let lk = if field == "bindFrom" {
                        "fromLabel"
                    } else {
                        "toLabel"
                    };
                    out.entry(lk).or_insert(json!(dflt));
                }
            }
            Kind::KeyValue => {
                let mut items = Vec::new();
                if let Some(Json::Array(rows)) = k.c.get("items") {
                    for row in rows {
                        items.push(self.kv_item(k.id, row, fails)?);
                    }
                }
                out.insert("items".into(), Json::Array(items));
            }
            Kind::EffectStatus => {
                if let Some(p) = k.c.get("errorPath").and_then(Json::as_str) {
                    let a = self.address(k.id, "errorPath", p)?;
                    out.insert("error".into(), self.value_at(&a));
                }
                let failed = k.value.is_some_and(is_failed);
                let retry = self.dyn_bool(k.id, k.c, "showRetry", failed, fails)?;
                out.insert("showRetry".into(), retry);
            }
            Kind::SectionList => {
                for f in ["canAdd", "canRemove"] {
                    if k.c.get(f).is_some_and(|v| !v.is_null()) {
                        let v = self.dyn_bool(k.id, k.c, f, true, fails)?;
                        out.insert(f.into(), v);
                    }
                }
                out.entry("addLabel").or_insert(json!("Add"));
                out.entry("removeLabel").or_insert(json!("Remove"));
            }
            _ => {}
        }
        Ok(())
    }

    fn kv_item(&mut self, id: &str, row: &Json, fails: &mut Failures) -> Result<Json, ViewError> {
        let mut o = Map::new();
        copy(row, &mut o, "label");
        if let Some(b) = row.get("bind").and_then(Json::as_str) {
            let a = self.address(id, "items[].bind", b)?;
            o.insert("bind".into(), json!(a.to_string()));
            o.insert("value".into(), self.value_at(&a));
        } else if let Some(t) = self.dollar_text(id, row, "text", fails)? {
            o.insert("text".into(), t);
        }
        copy(row, &mut o, "format");
        copy(row, &mut o, "currency");
        Ok(Json::Object(o))
    }

    fn rows_for(
        &mut self,
        id: &str,
        item_view: &str,
        list: &[Seg],
        elems: &[Json],
    ) -> Result<Vec<Json>, ViewError> {
        let view = find_view(self.views, item_view).ok_or_else(|| {
            ViewError::Invalid(format!(
                "component `{id}`: itemView `{item_view}` names no view"
            ))
        })?;
        if self.expanding.iter().any(|v| v == item_view) || self.expanding.len() > MAX_ITEM_DEPTH {
            return Err(ViewError::Invalid(format!(
                "component `{id}`: itemView `{item_view}` expands into itself"
            )));
        }
        self.expanding.push(item_view.to_string());
        let mut rows = Vec::with_capacity(elems.len());
        let mut result = Ok(());
        for (i, el) in elems.iter().enumerate() {
            let j = json_to_jvalue(el);
            let env = self
                .envs
                .last()
                .expect("base env")
                .with("self", j.clone())
                .with("parent", j);
            self.envs.push(env);
            self.rows.push((list.to_vec(), i));
            let comps = self.components(view.get("components"));
            self.rows.pop();
            self.envs.pop();
            match comps {
                Ok(comps) => {
                    let mut segs = list.to_vec();
                    segs.push(Seg::Index(i));
                    rows.push(json!({"index": i, "bind": render(&segs), "components": comps}));
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.expanding.pop();
        result.map(|_| rows)
    }
}

/// Whether a component of this kind shows the value it is bound to.
fn carries_value(kind: Kind, ty: &str) -> bool {
    !matches!(
        kind,
        Kind::Badge
            | Kind::Separator
            | Kind::StaticText
            | Kind::KeyValue
            | Kind::ValidationSummary
            | Kind::Button
            | Kind::Menu
            | Kind::TracePanel
            | Kind::DateRange
    ) && (kind != Kind::Container || ty == "sectionItem")
}

/// The limits a field shows (length, pattern, step, bounds: from `#meta` or the schema, a
/// numeric field's own `min`/`max` first) and the defaults some types have (`format`,
/// `allowCustom`).
fn limit_fields(
    c: &Json,
    ty: &str,
    kind: Kind,
    interactive: bool,
    limit_meta: impl Fn(MetaProp, &str) -> Option<Json>,
    out: &mut Map<String, Json>,
) {
    if interactive {
        for (prop, key) in [
            (MetaProp::MinLength, "minLength"),
            (MetaProp::MaxLength, "maxLength"),
            (MetaProp::Pattern, "pattern"),
            (MetaProp::MultipleOf, "multipleOf"),
        ] {
            if let Some(v) = limit_meta(prop, key) {
                out.insert(key.into(), v);
            }
        }
    }
    let numeric = matches!(ty, "numericField" | "currencyField" | "percentField")
        || matches!(kind, Kind::Slider | Kind::Progress);
    if numeric {
        let (dmin, dmax) = if ty == "ratingField" {
            (Some(json!(1)), Some(json!(5)))
        } else {
            (None, None)
        };
        for (field, prop, key, dflt) in [
            ("min", MetaProp::Minimum, "minimum", dmin),
            ("max", MetaProp::Maximum, "maximum", dmax),
        ] {
            let v = c
                .get(field)
                .filter(|v| !v.is_null())
                .cloned()
                .or_else(|| limit_meta(prop, key))
                .or(dflt);
            if let Some(v) = v {
                out.insert(field.into(), v);
            }
        }
        if ty == "ratingField" && !out.contains_key("step") {
            out.insert("step".into(), json!(1));
        }
    }
    let default_format = match ty {
        "currencyField" => Some("currency"),
        "percentField" => Some("percent"),
        "progressBar" | "gauge" => Some("percent"),
        "staticText" => Some("markdown"),
        _ => None,
    };
    if let Some(f) = default_format {
        out.entry("format").or_insert(json!(f));
    }
    if matches!(ty, "comboBox" | "tagsField") {
        out.entry("allowCustom").or_insert(json!(true));
    }
}

/// A component's failed expressions: `errors` (field, expression, message) and, but for an
/// effect status, a one-line `error`.
fn report_failures(kind: Kind, fails: Failures, out: &mut Map<String, Json>) {
    if !fails.is_empty() {
        if kind != Kind::EffectStatus {
            let summary: Vec<String> = fails
                .iter()
                .map(|(f, e, m)| format!("{f}: `{e}`: {m}"))
                .collect();
            out.insert("error".into(), json!(summary.join("; ")));
        }
        let errs: Vec<Json> = fails
            .into_iter()
            .map(|(f, e, m)| json!({"field": f, "expression": e, "message": m}))
            .collect();
        out.insert("errors".into(), Json::Array(errs));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Timestamp;
    use valem_core::spec::parse_spec;

    fn spec(view: Json) -> ModelSpec {
        parse_spec(&json!({
            "id": "m",
            "schema": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "number", "minimum": 0},
                "code": {"type": "string", "readOnly": true},
                "items": {"type": "array", "items": {"type": "object"}}
            }},
            "constants": {"greeting": "Hello", "rate": 2},
            "derivations": [{"path": "$.total", "expr": "$sum(items.qty)"}],
            "viewDefinition": view
        }))
        .unwrap()
    }

    fn doc() -> Json {
        json!({"name": "Ada", "age": 36, "code": "X1", "total": 5,
               "items": [{"qty": 2, "sku": "a"}, {"qty": 3, "sku": "b"}]})
    }

    fn eval(
        s: &ModelSpec,
        meta: &Map<String, Json>,
        view: Option<&str>,
    ) -> Result<Json, ViewError> {
        evaluate_view(
            s,
            &doc(),
            meta,
            view,
            Timestamp::default(),
            &Limits::default(),
        )
    }

    fn one(components: Json, meta: Map<String, Json>) -> Vec<Json> {
        let s = spec(json!({"defaultView": "main",
                             "views": [{"id": "main", "label": "Main", "components": components}]}));
        let v = eval(&s, &meta, None).unwrap();
        v["components"].as_array().unwrap().clone()
    }

    fn meta(pairs: &[(&str, Json)]) -> Map<String, Json> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    #[test]
    fn binds_values_and_inherits_meta() {
        let c = one(
            json!([
                {"id": "n", "type": "textField", "label": "Name", "bind": "$.name"},
                {"id": "a", "type": "numericField", "bind": "$.age"},
                {"id": "t", "type": "numericField", "bind": "$.total"},
                {"id": "c", "type": "textField", "bind": "$.code"},
                {"id": "q", "type": "numericField", "bind": "$.items[1].qty"},
                {"id": "missing", "type": "textField", "bind": "$.nope"}
            ]),
            meta(&[
                ("$.age#relevant", json!(false)),
                ("$.age#required", json!(true)),
                ("$.age#maximum", json!(120)),
                ("$.items[1].qty#read_only", json!(true)),
            ]),
        );
        assert_eq!(c[0]["value"], json!("Ada"));
        assert_eq!(c[0]["label"], json!("Name"));
        assert_eq!(c[0]["bind"], json!("$.name"));
        assert_eq!(c[0]["visible"], json!(true));
        assert_eq!(c[0]["readOnly"], json!(false));
        assert_eq!(c[0]["enabled"], json!(true));
        assert_eq!(c[0]["maxLength"], json!(40));
        assert_eq!(c[1]["visible"], json!(false));
        assert_eq!(c[1]["required"], json!(true));
        assert_eq!(c[1]["min"], json!(0), "schema minimum");
        assert_eq!(c[1]["max"], json!(120), "meta maximum");
        // A derived field is read-only and so not enabled.
        assert_eq!(c[2]["value"], json!(5));
        assert_eq!(c[2]["readOnly"], json!(true));
        assert_eq!(c[2]["enabled"], json!(false));
        // Schema `readOnly: true`.
        assert_eq!(c[3]["readOnly"], json!(true));
        assert_eq!(c[4]["value"], json!(3));
        assert_eq!(c[4]["readOnly"], json!(true));
        assert_eq!(c[5]["value"], Json::Null);
    }

    #[test]
    fn explicit_dynamics_override_meta() {
        let c = one(
            json!([
                {"id": "a", "type": "numericField", "bind": "$.age", "visible": "age > 30",
                 "readOnly": false, "enabled": "name = 'Bob'"},
                {"id": "b", "type": "badge", "text": "done", "visible": false}
            ]),
            meta(&[
                ("$.age#relevant", json!(false)),
                ("$.age#read_only", json!(true)),
            ]),
        );
        assert_eq!(c[0]["visible"], json!(true));
        assert_eq!(c[0]["readOnly"], json!(false));
        assert_eq!(c[0]["enabled"], json!(false));
        assert_eq!(c[1]["visible"], json!(false));
        assert!(c[1].get("bind").is_none() && c[1].get("enabled").is_none());
    }

    #[test]
    fn expression_fields_follow_the_dollar_rule() {
        let c = one(
            json!([
                {"id": "g", "type": "label", "text": "$const.greeting & ', ' & name & '!'"},
                {"id": "lit", "type": "label", "text": "name"},
                {"id": "b", "type": "badge", "text": "$string(total * $const.rate)",
                 "variant": "total > 3 ? 'danger' : 'primary'"},
                {"id": "v", "type": "badge", "text": "x", "variant": "$.total > 3 ? 'danger' : 'ok'"},
                {"id": "s", "type": "statTile", "value": "$sum(items.qty)", "caption": "units",
                 "delta": "$string(items[0].qty)"},
                {"id": "now", "type": "staticText", "text": "$now()"}
            ]),
            Map::new(),
        );
        assert_eq!(c[0]["text"], json!("Hello, Ada!"));
        assert_eq!(c[1]["text"], json!("name"));
        assert_eq!(c[2]["text"], json!("10"));
        assert_eq!(c[2]["variant"], json!("total > 3 ? 'danger' : 'primary'"));
        assert_eq!(c[3]["variant"], json!("danger"));
        assert_eq!(c[4]["value"], json!(5));
        assert_eq!(c[4]["caption"], json!("units"));
        assert_eq!(c[4]["delta"], json!("2"));
        assert_eq!(c[5]["text"], json!("1970-01-01T00:00:00.000Z"));
        assert_eq!(c[5]["format"], json!("markdown"));
    }

    #[test]
    fn item_view_renders_one_row_per_element() {
        let s = spec(json!({"defaultView": "main", "views": [
            {"id": "main", "components": [
                {"id": "list", "type": "sectionList", "bind": "$.items", "itemView": "line",
                 "canAdd": "$count(items) < 3"},
                {"id": "table", "type": "dataTable", "bind": "$.items",
                 "tableColumns": [{"field": "qty", "header": "Qty"}]}
            ]},
            {"id": "line", "components": [
                {"id": "ed", "type": "sectionItem", "bind": "$.items[0]", "components": [
                    {"id": "qty", "type": "numericField", "bind": "$.items[0].qty"},
                    {"id": "sku", "type": "textField", "bind": "$.items[*].sku",
                     "visible": "$self.qty > 2"},
                    {"id": "lbl", "type": "label", "text": "$string($parent.qty * $const.rate)"}
                ]}
            ]}
        ]}));
        let m = meta(&[("$.items[1].qty#relevant", json!(false))]);
        let v = eval(&s, &m, None).unwrap();
        let list = &v["components"][0];
        assert_eq!(list["canAdd"], json!(true));
        assert_eq!(list["addLabel"], json!("Add"));
        assert_eq!(list["value"], doc()["items"]);
        let rows = list["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 2);
        for (i, row) in rows.iter().enumerate() {
            assert_eq!(row["index"], json!(i));
            assert_eq!(row["bind"], json!(format!("$.items[{i}]")));
            let ed = &row["components"][0];
            assert_eq!(ed["bind"], json!(format!("$.items[{i}]")));
            let kids = ed["components"].as_array().unwrap();
            assert_eq!(kids[0]["bind"], json!(format!("$.items[{i}].qty")));
            assert_eq!(kids[0]["value"], doc()["items"][i]["qty"]);
            assert_eq!(kids[0]["visible"], json!(i == 0));
            assert_eq!(kids[1]["value"], doc()["items"][i]["sku"]);
            assert_eq!(kids[1]["visible"], json!(i == 1));
            let want = doc()["items"][i]["qty"].as_f64().unwrap() * 2.0;
            assert_eq!(kids[2]["text"], json!(format!("{want}")));
        }
        assert_eq!(v["components"][1]["value"], doc()["items"]);
        assert_eq!(v["components"][1]["tableColumns"][0]["field"], json!("qty"));
        // The item view alone keeps its template binds.
        let line = eval(&s, &m, Some("line")).unwrap();
        assert_eq!(line["components"][0]["components"][0]["value"], json!(2));
    }

    #[test]
    fn view_selection_and_errors() {
        let views = json!({"defaultView": "second", "views": [
            {"id": "first", "label": "One", "components": []},
            {"id": "second", "title": "Two", "layout": "grid", "columns": 2, "components": []}
        ]});
        let s = spec(views.clone());
        let v = eval(&s, &Map::new(), None).unwrap();
        assert_eq!(v["viewId"], json!("second"));
        assert_eq!(v["title"], json!("Two"));
        assert_eq!(v["layout"], json!("grid"));
        assert_eq!(v["modelId"], json!("m"));
        let v = eval(&s, &Map::new(), Some("first")).unwrap();
        assert_eq!(
            (v["title"].clone(), v["layout"].clone()),
            (json!("One"), json!("vertical"))
        );
        assert_eq!(
            eval(&s, &Map::new(), Some("nope")),
            Err(ViewError::UnknownView("nope".into()))
        );
        // No defaultView: the first view.
        let s = spec(json!({"views": [{"id": "only", "components": []}]}));
        assert_eq!(
            eval(&s, &Map::new(), None).unwrap()["viewId"],
            json!("only")
        );
        let mut s = spec(views);
        s.view_definition = None;
        assert_eq!(
            eval(&s, &Map::new(), None),
            Err(ViewError::NoView("m".into()))
        );
    }

    #[test]
    fn bad_expressions_are_reported() {
        let s = spec(json!({"views": [{"id": "v", "components": [
            {"id": "broken", "type": "badge", "text": "$string(1 + + 2)"}
        ]}]}));
        match eval(&s, &Map::new(), None) {
            Err(ViewError::Invalid(m)) => {
                assert!(
                    m.contains("broken") && m.contains("$string(1 + + 2)"),
                    "{m}"
                )
            }
            other => panic!("{other:?}"),
        }
        let c = one(
            json!([
                {"id": "bad", "type": "label", "bind": "$.name", "text": "$string(name + 1)"},
                {"id": "badVis", "type": "textField", "bind": "$.name", "visible": "name + 1"},
                {"id": "fine", "type": "label", "text": "$string(age)"}
            ]),
            Map::new(),
        );
        assert_eq!(c[0]["text"], Json::Null);
        assert_eq!(c[0]["value"], json!("Ada"));
        assert!(c[0]["error"].as_str().unwrap().contains("text"), "{}", c[0]);
        assert_eq!(c[0]["errors"][0]["field"], json!("text"));
        assert_eq!(c[1]["visible"], Json::Null);
        assert!(c[1]["error"].is_string());
        assert_eq!(c[2]["text"], json!("36"));
        assert!(c[2].get("error").is_none());
    }

    #[test]
    fn options_key_values_and_date_ranges() {
        let c = one(
            json!([
                {"id": "s", "type": "selectField", "bind": "$.name",
                 "options": [{"value": "Ada", "label": "Ada L."}]},
                {"id": "e", "type": "selectField", "bind": "$.name",
                 "optionsExpr": "items.sku"},
                {"id": "kv", "type": "keyValueList", "items": [
                    {"label": "Total", "bind": "$.total", "text": "$string(1)"},
                    {"label": "Twice", "text": "$string(total * 2)"}]},
                {"id": "d", "type": "dateRangeField", "bindFrom": "$.name", "bindTo": "$.code"}
            ]),
            meta(&[("$.name#enum", json!(["Ada", "Bob"]))]),
        );
        assert_eq!(c[0]["options"][0]["label"], json!("Ada L."));
        assert_eq!(
            c[1]["options"],
            json!([{"value": "a", "label": "a"}, {"value": "b", "label": "b"}])
        );
        assert_eq!(c[2]["items"][0]["value"], json!(5));
        assert!(c[2]["items"][0].get("text").is_none());
        assert_eq!(c[2]["items"][1]["text"], json!("10"));
        assert_eq!(c[3]["valueFrom"], json!("Ada"));
        assert_eq!(c[3]["valueTo"], json!("X1"));
        assert_eq!(c[3]["readOnly"], json!(false));
    }

    /// Every component in `list` (recursively, through children and item-view rows).
    fn walk<'j>(list: &'j Json, out: &mut Vec<&'j Json>) {
        for c in list.as_array().into_iter().flatten() {
            out.push(c);
            walk(&c["components"], out);
            for row in c["rows"].as_array().into_iter().flatten() {
                walk(&row["components"], out);
            }
        }
    }

    /// Evaluate every view of `spec` in `model`'s state; assert no component failed and every
    /// bind shows the merged value. Returns the number of item-view rows seen.
    fn check_views(label: &str, spec: &ModelSpec, model: &mut crate::Model) -> usize {
        let merged = model.merged_json(Timestamp::default());
        let meta = model.state().meta_json();
        let merged_val = valem_core::value::Val::from_json(&merged);
        let mut rows = 0;
        let def = spec.view_definition.as_ref().unwrap();
        for view in def["views"].as_array().unwrap() {
            let id = view["id"].as_str().unwrap();
            let v = evaluate_view(
                spec,
                &merged,
                &meta,
                Some(id),
                Timestamp::default(),
                &Limits::default(),
            )
            .unwrap_or_else(|e| panic!("{label}/{id}: {e}"));
            assert_eq!(v["viewId"], json!(id));
            let mut all = Vec::new();
            walk(&v["components"], &mut all);
            assert!(!all.is_empty(), "{label}/{id}");
            for c in all {
                assert!(c.get("errors").is_none(), "{label}/{id}: {c}");
                if c["type"] != "effectStatus" {
                    assert!(c.get("error").is_none(), "{label}/{id}: {c}");
                }
                rows += c["rows"].as_array().map_or(0, Vec::len);
                if let Some(b) = c.get("bind").and_then(Json::as_str) {
                    if c.get("value").is_none() {
                        continue; // a declaration (trace panels)
                    }
                    let a = Address::parse(b).unwrap();
                    let want = a
                        .concrete()
                        .and_then(|s| merged_val.get_path(&s).map(|x| x.to_json()))
                        .unwrap_or(Json::Null);
                    assert_eq!(c["value"], want, "{label}/{id}: {c}");
                }
            }
        }
        rows
    }

    #[test]
    fn every_bundled_view_evaluates_cleanly() {
        let mut with_views = 0;
        let mut rows = 0;
        for (name, text) in valem_core::examples::ALL {
            let spec = valem_core::spec::parse_spec_text(text).unwrap();
            if spec.view_definition.is_none() {
                continue;
            }
            with_views += 1;
            let create = || {
                crate::Model::create(&spec, Timestamp::default(), Default::default())
                    .unwrap()
                    .0
            };
            rows += check_views(name, &spec, &mut create());
            // And in the state each of the spec's own tests sets up.
            for (i, t) in spec.tests.iter().enumerate() {
                let mut model = create();
                let given: Vec<(String, Json)> = t
                    .given
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                if model.mutate(&given, Timestamp::default()).is_ok() {
                    rows += check_views(&format!("{name} tests[{i}]"), &spec, &mut model);
                }
            }
        }
        assert!(with_views >= 11, "{with_views}");
        assert!(rows > 0, "no example state exercised an itemView");
    }
}
