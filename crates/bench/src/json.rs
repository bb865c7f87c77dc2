//! JSON for the report: serde_json's `Value` (with `preserve_order`, so saved reports keep
//! the order the table prints them in) and the few constructors the report needs.

pub use serde_json::Value;

/// A number, or null if it is not finite (JSON has no NaN or infinity). Whole numbers are
/// written without a fraction (`2248`, not `2248.0`).
pub fn number(value: f64) -> Value {
    if value.is_finite() && value.fract() == 0.0 && value.abs() < 1e15 {
        Value::from(value as i64)
    } else {
        // serde_json makes a non-finite f64 null.
        Value::from(value)
    }
}

pub fn string(text: impl Into<String>) -> Value {
    Value::String(text.into())
}

/// An object with its members in this order.
pub fn object<K: Into<String>>(members: impl IntoIterator<Item = (K, Value)>) -> Value {
    Value::Object(
        members
            .into_iter()
            .map(|(key, value)| (key.into(), value))
            .collect(),
    )
}

/// Pretty-printed text, ending in a newline.
pub fn to_pretty(value: &Value) -> String {
    let mut text = serde_json::to_string_pretty(value).expect("a Value always serializes");
    text.push('\n');
    text
}

/// Parse one JSON document (serde_json bounds the nesting, so a hostile file cannot
/// overflow the stack).
pub fn parse(text: &str) -> Result<Value, serde_json::Error> {
    serde_json::from_str(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_round_trip_in_their_own_order() {
        let report = object([
            ("zeta", number(1.0)),
            ("alpha", number(2.5)),
            ("missing", number(f64::NAN)),
            ("name", string("a \"quoted\"\nname")),
            ("list", Value::Array(vec![number(3.0), Value::Bool(true)])),
        ]);
        let text = to_pretty(&report);
        assert!(text.contains("\"zeta\": 1,"), "{text}");
        assert!(text.find("zeta") < text.find("alpha"), "order kept: {text}");
        assert_eq!(parse(&text).expect("parses"), report);
        assert!(report["missing"].is_null());
        assert_eq!(report["alpha"].as_f64(), Some(2.5));
    }

    #[test]
    fn malformed_and_too_deep_documents_are_refused() {
        for text in ["", "{", "[1,]", "{\"a\" 1}", "nul", "1 2", "\"\\x\""] {
            assert!(parse(text).is_err(), "{text:?} parsed");
        }
        let deep = "[".repeat(100_000) + &"]".repeat(100_000);
        assert!(parse(&deep).is_err());
    }
}
