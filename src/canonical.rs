//! Canonical JSON, written straight from the request's bytes: object keys in
//! byte order, no insignificant white space, strings escaped the way
//! serde_json escapes them, numbers with every digit as written (what
//! serde_json's `arbitrary_precision` keeps). Two equal JSON values
//! have the same canonical text, so it can be digested and compared.
//!
//! It never builds a `serde_json::Value` tree (which, with
//! `arbitrary_precision`, costs tens of bytes per byte of input): each value
//! is visited as a borrowed slice of the input, arrays one element at a time,
//! so memory stays a small multiple of the text it writes.

use std::fmt;

use serde::de::{Deserializer as _, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// Why a text could not be made canonical.
#[derive(Debug)]
pub enum CanonicalError {
    /// Not JSON (a lone surrogate escape, say).
    Malformed(serde_json::Error),
    /// A string or key holds a NUL, which the stores cannot keep; the text
    /// is the JSON path of it.
    Nul(String),
}

impl From<serde_json::Error> for CanonicalError {
    fn from(e: serde_json::Error) -> Self {
        Self::Malformed(e)
    }
}

/// Where a value sits, rendered only when an error names it.
#[derive(Clone, Copy)]
pub enum JsonPath<'a> {
    Root(&'a str),
    Key(&'a JsonPath<'a>, &'a str),
    Index(&'a JsonPath<'a>, usize),
}

impl fmt::Display for JsonPath<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Root(name) => f.write_str(name),
            Self::Key(parent, key) => write!(f, "{parent}.{key}"),
            Self::Index(parent, i) => write!(f, "{parent}[{i}]"),
        }
    }
}

/// The kind of the JSON value `raw`, for error details.
pub fn kind(raw: &RawValue) -> &'static str {
    match raw.get().trim_start().as_bytes().first() {
        Some(b'{') => "an object",
        Some(b'[') => "a list",
        Some(b'"') => "a string",
        Some(b't' | b'f') => "a boolean",
        Some(b'n') => "null",
        _ => "a number",
    }
}

/// Appends the canonical text of `raw` to `out`.
pub fn write(raw: &RawValue, path: JsonPath<'_>, out: &mut String) -> Result<(), CanonicalError> {
    let text = raw.get().trim();
    match text.as_bytes().first() {
        Some(b'{') => write_object(text, path, out),
        Some(b'[') => write_array(text, path, out),
        Some(b'"') => {
            let s: String = serde_json::from_str(text)?;
            write_string(&s, path, out)
        }
        Some(b'-' | b'0'..=b'9') => {
            write_number(text, out);
            Ok(())
        }
        // `true`, `false`, `null`.
        _ => {
            out.push_str(text);
            Ok(())
        }
    }
}

/// A number as `arbitrary_precision` keeps it: every digit as written, the
/// exponent marker as `e` with an explicit sign.
fn write_number(text: &str, out: &mut String) {
    match text.split_once(['e', 'E']) {
        None => out.push_str(text),
        Some((mantissa, exponent)) => {
            out.push_str(mantissa);
            out.push('e');
            if !exponent.starts_with(['+', '-']) {
                out.push('+');
            }
            out.push_str(exponent);
        }
    }
}

fn write_string(s: &str, path: JsonPath<'_>, out: &mut String) -> Result<(), CanonicalError> {
    if s.contains('\0') {
        return Err(CanonicalError::Nul(path.to_string()));
    }
    out.push_str(&serde_json::to_string(s)?);
    Ok(())
}

fn write_object(text: &str, path: JsonPath<'_>, out: &mut String) -> Result<(), CanonicalError> {
    let mut entries: Vec<(String, &RawValue)> = entries(text)?;
    // Stable, so that of repeated keys the last one wins, as in serde_json.
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    out.push('{');
    let mut first = true;
    for (i, (key, value)) in entries.iter().enumerate() {
        if entries.get(i + 1).is_some_and(|next| next.0 == *key) {
            continue;
        }
        if key.contains('\0') {
            return Err(CanonicalError::Nul(format!("a key in {path}")));
        }
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(&serde_json::to_string(key)?);
        out.push(':');
        write(value, JsonPath::Key(&path, key), out)?;
    }
    out.push('}');
    Ok(())
}

/// The members of the object `text`, in the order written.
pub fn entries(text: &str) -> Result<Vec<(String, &RawValue)>, serde_json::Error> {
    struct Entries;
    impl<'de> Visitor<'de> for Entries {
        type Value = Vec<(String, &'de RawValue)>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut entries = Vec::new();
            while let Some(entry) = map.next_entry::<String, &'de RawValue>()? {
                entries.push(entry);
            }
            Ok(entries)
        }
    }
    serde_json::Deserializer::from_str(text).deserialize_map(Entries)
}

fn write_array(text: &str, path: JsonPath<'_>, out: &mut String) -> Result<(), CanonicalError> {
    out.push('[');
    let mut failure = None;
    let visited = for_each_element(text, |i, element| {
        if i > 0 {
            out.push(',');
        }
        match write(element, JsonPath::Index(&path, i), out) {
            Ok(()) => true,
            Err(e) => {
                failure = Some(e);
                false
            }
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    visited?;
    out.push(']');
    Ok(())
}

/// Calls `each` with every element of the array `text`, in order, one at a
/// time (no list of them is built), until it returns false.
pub fn for_each_element<'t>(
    text: &'t str,
    each: impl FnMut(usize, &'t RawValue) -> bool,
) -> Result<(), serde_json::Error> {
    struct Elements<F>(F);
    impl<'de, F: FnMut(usize, &'de RawValue) -> bool> Visitor<'de> for Elements<F> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a list")
        }
        fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
            let mut i = 0;
            while let Some(element) = seq.next_element::<&'de RawValue>()? {
                if !(self.0)(i, element) {
                    // Stop early: the rest is skipped without being kept.
                    while seq.next_element::<IgnoredAny>()?.is_some() {}
                    return Ok(());
                }
                i += 1;
            }
            Ok(())
        }
    }
    serde_json::Deserializer::from_str(text).deserialize_seq(Elements(each))
}

/// How many elements the array `text` has, without keeping any.
pub fn count_elements(text: &str) -> Result<usize, serde_json::Error> {
    let mut n = 0;
    for_each_element(text, |_, _| {
        n += 1;
        true
    })?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canonical(text: &str) -> Result<String, CanonicalError> {
        let raw: &RawValue = serde_json::from_str(text)?;
        let mut out = String::new();
        write(raw, JsonPath::Root("m"), &mut out)?;
        Ok(out)
    }

    #[test]
    fn matches_serde_json_value_serialisation() {
        for text in [
            r#"{"role":"user","content":"hi"}"#,
            r#" { "b" : [1, 2.50, -0, 1e5, 1E+2, 123456789012345678901234567890], "a" : null } "#,
            r#"{"z":{"y":[{"x":true,"w":false}]},"é":"\u00e9\u0041\n\t\"\\/","a":"😀"}"#,
            r#"{"dup":1,"dup":2,"a":[[],{}],"e":"\ud83d\ude00"}"#,
            r#"[1,"two",{"three":3}]"#,
            r#""just a string""#,
        ] {
            let value: serde_json::Value = serde_json::from_str(text).unwrap();
            assert_eq!(
                canonical(text).unwrap(),
                serde_json::to_string(&value).unwrap(),
                "{text}"
            );
        }
    }

    #[test]
    fn nul_is_found_with_its_path() {
        let Err(CanonicalError::Nul(path)) = canonical(r#"{"a":[0,{"b":"x\u0000"}]}"#) else {
            panic!("a NUL must be refused");
        };
        assert_eq!(path, "m.a[1].b");
        let Err(CanonicalError::Nul(path)) = canonical(r#"{"a":{"k\u0000":1}}"#) else {
            panic!("a NUL in a key must be refused");
        };
        assert_eq!(path, "a key in m.a");
    }

    #[test]
    fn lone_surrogates_are_malformed() {
        assert!(matches!(
            canonical(r#"{"a":"\ud800"}"#),
            Err(CanonicalError::Malformed(_))
        ));
    }

    #[test]
    fn counts_without_keeping() {
        assert_eq!(count_elements("[1, [2, 3], {\"a\": 4}]").unwrap(), 3);
        assert_eq!(count_elements("[]").unwrap(), 0);
    }
}
