//! The canonical address dialect: `$`-rooted JSON Path with dot members and bracket indices
//! (`$.items[0].qty`, `$.items[*].qty`, `$['odd key']`). Parses, renders and rewrites addresses;
//! never evaluates anything. Legacy dot-index (`$.items.0.x`) and unrooted (`items.0.x`) forms are
//! rejected with the canonical rewrite in the message, as the reference validator does.

use std::fmt;

use crate::value::{Key, Seg};

/// One step of an address pattern.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PathSeg {
    Field(Key),
    Index(usize),
    /// `[*]`: every element of an array.
    Wild,
}

/// A parsed canonical address; may contain `[*]`. Its segments are kept in the address when
/// there is one (a top-level member: most targets), so that it allocates nothing: 24 bytes,
/// as a `Vec`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Address {
    pub segs: Segs,
}

/// The segments of an [`Address`].
pub type Segs = smallvec::SmallVec<[PathSeg; 1]>;

#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Address>() == 24);

/// Why a text is not a canonical address.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct AddressError {
    pub message: String,
    /// The canonical form, when the input was a recognisable legacy or unrooted address.
    pub rewrite: Option<String>,
}

/// Longest address we accept, in characters and in segments.
pub const MAX_ADDRESS_LEN: usize = 4096;
const MAX_SEGMENTS: usize = 256;

impl Address {
    pub fn root() -> Address {
        Address { segs: Segs::new() }
    }

    pub fn parse(text: &str) -> Result<Address, AddressError> {
        Address::parse_as(text, &mut crate::value::intern)
    }

    /// [`Address::parse`] with its member names made by `key` (a caller on another thread than
    /// the model's shares them in a table of its own rather than in that thread's names).
    pub fn parse_with(
        text: &str,
        key: &mut dyn FnMut(&str) -> Key,
    ) -> Result<Address, AddressError> {
        Address::parse_as(text, key)
    }

    /// [`Address::parse`] for an address used once, a mutation's: its member names are not
    /// interned (a probe of the thread's name table costs more than the allocation). A name
    /// becomes the shared key only if the write stores it as a new member
    /// ([`crate::value::ObjMap::insert`]); lookups compare the bytes of unshared keys.
    pub fn parse_transient(text: &str) -> Result<Address, AddressError> {
        Address::parse_as(text, &mut |s| Key::from(s))
    }

    fn parse_as(text: &str, key: &mut dyn FnMut(&str) -> Key) -> Result<Address, AddressError> {
        if text.len() > MAX_ADDRESS_LEN {
            return Err(AddressError {
                message: format!("address is longer than {MAX_ADDRESS_LEN} characters"),
                rewrite: None,
            });
        }
        let t = text.trim();
        if t.is_empty() {
            return Err(AddressError {
                message: "address is empty; use `$` for the root or `$.field`".into(),
                rewrite: None,
            });
        }
        if !t.starts_with('$') {
            let rewrite = lenient(&format!("$.{t}")).map(|a| a.to_string());
            return Err(AddressError {
                message: match &rewrite {
                    Some(r) => format!("address `{t}` is not rooted at `$`; write `{r}`"),
                    None => format!("address `{t}` is not rooted at `$`"),
                },
                rewrite,
            });
        }
        if let Some(segs) = plain(t, key) {
            return Ok(Address { segs });
        }
        match strict(t, key) {
            Ok(a) => Ok(a),
            Err(e) => {
                let rewrite = lenient(t).map(|a| a.to_string()).filter(|r| r != t);
                Err(match rewrite {
                    Some(r) => AddressError {
                        message: format!(
                            "address `{t}` uses a non-canonical form ({e}); write `{r}`"
                        ),
                        rewrite: Some(r),
                    },
                    None => AddressError {
                        message: format!("invalid address `{t}`: {e}"),
                        rewrite: None,
                    },
                })
            }
        }
    }

    pub fn is_root(&self) -> bool {
        self.segs.is_empty()
    }

    pub fn has_wildcard(&self) -> bool {
        self.segs.iter().any(|s| matches!(s, PathSeg::Wild))
    }

    pub fn wildcard_count(&self) -> usize {
        self.segs
            .iter()
            .filter(|s| matches!(s, PathSeg::Wild))
            .count()
    }

    /// The concrete segments, or `None` when the address has a `[*]`.
    pub fn concrete(&self) -> Option<Vec<Seg>> {
        self.segs
            .iter()
            .map(|s| match s {
                PathSeg::Field(k) => Some(Seg::Field(k.clone())),
                PathSeg::Index(i) => Some(Seg::Index(*i)),
                PathSeg::Wild => None,
            })
            .collect()
    }

    /// [`Address::concrete`], taking the address apart (its names are moved, not shared).
    pub fn into_concrete(self) -> Option<Vec<Seg>> {
        self.segs
            .into_iter()
            .map(|s| match s {
                PathSeg::Field(k) => Some(Seg::Field(k)),
                PathSeg::Index(i) => Some(Seg::Index(i)),
                PathSeg::Wild => None,
            })
            .collect()
    }

    pub fn from_concrete(segs: &[Seg]) -> Address {
        Address {
            segs: segs
                .iter()
                .map(|s| match s {
                    Seg::Field(k) => PathSeg::Field(k.clone()),
                    Seg::Index(i) => PathSeg::Index(*i),
                })
                .collect(),
        }
    }

    /// The address without its last segment (root stays root).
    pub fn parent(&self) -> Address {
        // The segments above the last, copied (not all of them copied and the last dropped:
        // two atomic operations on a shared name for nothing).
        let above = self.segs.len().saturating_sub(1);
        Address {
            segs: self.segs[..above].iter().cloned().collect(),
        }
    }

    /// The prefix up to and including the last `[*]`, or `None` without wildcards.
    pub fn element_pattern(&self) -> Option<Address> {
        let last = self.segs.iter().rposition(|s| matches!(s, PathSeg::Wild))?;
        Some(Address {
            segs: self.segs[..=last].into(),
        })
    }

    pub fn child(&self, seg: PathSeg) -> Address {
        let mut segs = self.segs.clone();
        segs.push(seg);
        Address { segs }
    }

    /// Whether `self` is `other` or one of its ancestors (segment-wise; `[*]` matches an index).
    pub fn is_prefix_of(&self, other: &Address) -> bool {
        self.segs.len() <= other.segs.len()
            && self
                .segs
                .iter()
                .zip(&other.segs)
                .all(|(a, b)| seg_matches(a, b))
    }
}

fn seg_matches(a: &PathSeg, b: &PathSeg) -> bool {
    match (a, b) {
        (PathSeg::Wild, PathSeg::Index(_)) | (PathSeg::Index(_), PathSeg::Wild) => true,
        _ => a == b,
    }
}

/// Render a concrete path canonically.
pub fn render(segs: &[Seg]) -> String {
    let mut s = String::new();
    render_into(segs, &mut s);
    s
}

/// `render` into `s` (cleared first), allocating only when `s` must grow.
pub fn render_into(segs: &[Seg], s: &mut String) {
    s.clear();
    render_append(segs, s);
}

/// `render` at the end of `s`.
pub fn render_append(segs: &[Seg], s: &mut String) {
    s.push('$');
    for seg in segs {
        match seg {
            Seg::Field(k) => push_field(s, k),
            Seg::Index(i) => push_index(s, *i),
        }
    }
}

pub fn push_field(s: &mut String, k: &str) {
    if is_identifier(k) {
        s.push('.');
        s.push_str(k);
    } else {
        s.push_str("['");
        for c in k.chars() {
            match c {
                '\'' => s.push_str("\\'"),
                '\\' => s.push_str("\\\\"),
                c => s.push(c),
            }
        }
        s.push_str("']");
    }
}

/// A member name that needs no quoting: `[A-Za-z_][A-Za-z0-9_-]*` (not all digits).
pub fn is_identifier(k: &str) -> bool {
    let mut chars = k.chars();
    match chars.next() {
        Some(c) if c.is_ascii_alphabetic() || c == '_' => {}
        _ => return false,
    }
    chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Append an index step (`[3]`) to an address being written.
pub fn push_index(s: &mut String, i: usize) {
    use std::fmt::Write;
    // Writing to a String cannot fail.
    let _ = write!(s, "[{i}]");
}

impl Address {
    /// The canonical text, appended to `s` (what `Display` writes).
    pub fn render_into(&self, s: &mut String) {
        s.push('$');
        for seg in &self.segs {
            match seg {
                PathSeg::Field(k) => push_field(s, k),
                PathSeg::Index(i) => push_index(s, *i),
                PathSeg::Wild => s.push_str("[*]"),
            }
        }
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = String::new();
        self.render_into(&mut s);
        f.write_str(&s)
    }
}

/// The common case of the strict grammar read straight from the bytes: `$` then `.name`
/// members (identifiers) and `[n]` indices only. `None` for anything else (quoted names,
/// `[*]`, non-ASCII text, errors): [`strict`] reads those and words the errors.
fn plain(t: &str, key: &mut dyn FnMut(&str) -> Key) -> Option<Segs> {
    let b = t.as_bytes();
    let count = b.iter().filter(|&&c| c == b'.' || c == b'[').count();
    if count > MAX_SEGMENTS || b.first() != Some(&b'$') {
        return None;
    }
    let mut segs = Segs::with_capacity(count);
    let mut i = 1;
    while i < b.len() {
        let start = i + 1;
        let mut end = start;
        match b[i] {
            b'.' => {
                while end < b.len() && b[end] != b'.' && b[end] != b'[' {
                    end += 1;
                }
                let name = t.get(start..end)?;
                if !is_identifier(name) {
                    return None;
                }
                segs.push(PathSeg::Field(key(name)));
                i = end;
            }
            b'[' => {
                while end < b.len() && b[end].is_ascii_digit() {
                    end += 1;
                }
                if end == start || b.get(end) != Some(&b']') {
                    return None;
                }
                segs.push(PathSeg::Index(t.get(start..end)?.parse().ok()?));
                i = end + 1;
            }
            _ => return None,
        }
    }
    Some(segs)
}

/// The strict grammar: `$` then `.name`, `[n]`, `[*]`, `['name']` / `["name"]`.
fn strict(t: &str, key: &mut dyn FnMut(&str) -> Key) -> Result<Address, String> {
    let chars: Vec<char> = t.chars().collect();
    let mut i = 1; // after '$'
    let mut segs = Segs::new();
    while i < chars.len() {
        if segs.len() >= MAX_SEGMENTS {
            return Err(format!("more than {MAX_SEGMENTS} segments"));
        }
        match chars[i] {
            '.' => {
                i += 1;
                let start = i;
                while i < chars.len() && chars[i] != '.' && chars[i] != '[' {
                    i += 1;
                }
                let name: String = chars[start..i].iter().collect();
                if name.is_empty() {
                    return Err(format!("empty member name at position {start}"));
                }
                if name.chars().all(|c| c.is_ascii_digit()) {
                    return Err(format!("dot-index `.{name}`"));
                }
                if name == "*" {
                    return Err("`.*` wildcard".into());
                }
                if !is_identifier(&name) {
                    return Err(format!("member `{name}` needs the bracket form"));
                }
                segs.push(PathSeg::Field(key(&name)));
            }
            '[' => {
                i += 1;
                if i < chars.len() && (chars[i] == '\'' || chars[i] == '"') {
                    let quote = chars[i];
                    i += 1;
                    let mut name = String::new();
                    loop {
                        match chars.get(i) {
                            None => return Err("unterminated quoted member".into()),
                            Some('\\') => {
                                match chars.get(i + 1) {
                                    Some(c) => name.push(*c),
                                    None => return Err("unterminated quoted member".into()),
                                }
                                i += 2;
                            }
                            Some(c) if *c == quote => {
                                i += 1;
                                break;
                            }
                            Some(c) => {
                                name.push(*c);
                                i += 1;
                            }
                        }
                    }
                    if chars.get(i) != Some(&']') {
                        return Err(format!("expected `]` at position {i}"));
                    }
                    i += 1;
                    segs.push(PathSeg::Field(key(&name)));
                } else {
                    let start = i;
                    while i < chars.len() && chars[i] != ']' {
                        i += 1;
                    }
                    if i >= chars.len() {
                        return Err("unterminated `[`".into());
                    }
                    let inner: String = chars[start..i].iter().collect();
                    i += 1;
                    if inner == "*" {
                        segs.push(PathSeg::Wild);
                    } else if !inner.is_empty() && inner.chars().all(|c| c.is_ascii_digit()) {
                        let n: usize = inner
                            .parse()
                            .map_err(|_| format!("index `{inner}` is too large"))?;
                        segs.push(PathSeg::Index(n));
                    } else {
                        return Err(format!(
                            "bracket selector `[{inner}]` is not an index, `*` or a quoted name"
                        ));
                    }
                }
            }
            c => return Err(format!("unexpected `{c}` at position {i}")),
        }
    }
    // Addresses are kept (targets of compiled nodes): no spare capacity.
    segs.shrink_to_fit();
    Ok(Address { segs })
}

/// A forgiving reading used only to suggest the canonical rewrite: dot-indices become indices,
/// `.*` becomes `[*]`, odd member names are quoted.
fn lenient(t: &str) -> Option<Address> {
    let body = t.strip_prefix('$')?;
    let mut segs = Segs::new();
    for part in body.split('.').skip(1) {
        if part.is_empty() {
            return None;
        }
        let (name, brackets) = match part.find('[') {
            Some(p) => (&part[..p], &part[p..]),
            None => (part, ""),
        };
        if !name.is_empty() {
            if name == "*" {
                segs.push(PathSeg::Wild);
            } else if name.chars().all(|c| c.is_ascii_digit()) {
                segs.push(PathSeg::Index(name.parse().ok()?));
            } else {
                segs.push(PathSeg::Field(Key::from(name)));
            }
        }
        let mut rest = brackets;
        while !rest.is_empty() {
            let close = rest.find(']')?;
            let inner = &rest[1..close];
            if inner == "*" {
                segs.push(PathSeg::Wild);
            } else {
                segs.push(PathSeg::Index(inner.parse().ok()?));
            }
            rest = &rest[close + 1..];
            if !rest.is_empty() && !rest.starts_with('[') {
                return None;
            }
        }
    }
    if body.is_empty() || body.starts_with('.') {
        Some(Address { segs })
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_canonical_forms() {
        for t in [
            "$",
            "$.a",
            "$.a.b",
            "$.items[0].qty",
            "$.items[*].qty",
            "$['odd key'].x",
        ] {
            let a = Address::parse(t).unwrap();
            assert_eq!(a.to_string(), t);
        }
        assert_eq!(Address::parse("$[\"x\"]").unwrap().to_string(), "$.x");
    }

    /// The byte-level reader of plain addresses agrees with the general one wherever it
    /// answers, and leaves every other text (and every error) to it.
    #[test]
    fn the_plain_reader_agrees_with_the_strict_grammar() {
        let deep = format!("${}", ".a".repeat(MAX_SEGMENTS + 1));
        let many = format!("${}", "[1]".repeat(MAX_SEGMENTS));
        let texts = [
            "$",
            "$.a",
            "$.price_7.qty-2[0][12].b",
            "$.items[007].x",
            "$.",
            "$..a",
            "$.a.",
            "$[",
            "$[]",
            "$[1",
            "$[1]x",
            "$.7",
            "$.7a",
            "$.a b",
            "$.*",
            "$[*]",
            "$['q'].a",
            "$.é",
            "$.a[99999999999999999999999]",
            "$x",
            deep.as_str(),
            many.as_str(),
        ];
        let mut answered = 0;
        for t in texts {
            let general = strict(t, &mut crate::value::intern).map(|a| a.segs);
            match plain(t, &mut crate::value::intern) {
                Some(segs) => {
                    answered += 1;
                    assert_eq!(Ok(segs), general, "{t}");
                }
                None => assert!(
                    general.is_err() || t.contains(['*', '\'', 'é']),
                    "{t} is plain but was left to the general reader"
                ),
            }
        }
        assert_eq!(answered, 5);
        // Transient parses give the same address, with keys that are not the shared ones.
        let shared = Address::parse("$.price_7[1].qty").unwrap();
        let own = Address::parse_transient("$.price_7[1].qty").unwrap();
        assert_eq!(own, shared);
        let (PathSeg::Field(a), PathSeg::Field(b)) = (&own.segs[0], &shared.segs[0]) else {
            panic!("a member first")
        };
        assert!(!Key::ptr_eq(a, b));
    }

    #[test]
    fn concrete_segments_with_and_without_taking_the_address_apart() {
        let a = Address::parse("$.items[3]['a b']").unwrap();
        let segs = a.concrete().unwrap();
        assert_eq!(render(&segs), "$.items[3]['a b']");
        assert_eq!(a.clone().into_concrete(), Some(segs));
        assert_eq!(
            Address::parse("$.items[*].q").unwrap().into_concrete(),
            None
        );
    }

    #[test]
    fn rejects_legacy_forms_with_rewrite() {
        let e = Address::parse("$.items.0.name").unwrap_err();
        assert_eq!(e.rewrite.as_deref(), Some("$.items[0].name"));
        assert!(e.message.contains("$.items[0].name"), "{}", e.message);
        let e = Address::parse("items.0.name").unwrap_err();
        assert_eq!(e.rewrite.as_deref(), Some("$.items[0].name"));
        let e = Address::parse("total").unwrap_err();
        assert_eq!(e.rewrite.as_deref(), Some("$.total"));
        let e = Address::parse("$.items.*.x").unwrap_err();
        assert_eq!(e.rewrite.as_deref(), Some("$.items[*].x"));
    }

    #[test]
    fn rejects_garbage_without_panicking() {
        for t in [
            "", "$.", "$[", "$[x]", "$..a", "$.a[1", "$['a", "$.a]", "$$",
        ] {
            assert!(Address::parse(t).is_err(), "{t}");
        }
    }

    #[test]
    fn prefix_matching_treats_wildcards_as_any_index() {
        let p = Address::parse("$.items[*]").unwrap();
        let c = Address::parse("$.items[3].qty").unwrap();
        assert!(p.is_prefix_of(&c));
        assert!(!c.is_prefix_of(&p));
    }
}
