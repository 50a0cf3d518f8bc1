//! A call's arguments as the runtime takes them.

use std::borrow::Cow;

use serde_json::Value;

/// A call's arguments, with their canonical text when the caller has printed it already:
/// the saga engine prints it once per step for the idempotency key, and a sandboxed call
/// hands the guest that text instead of printing the arguments again on every attempt and
/// every run after a conflict.
#[derive(Clone, Copy, Debug)]
pub struct CallArgs<'a> {
    value: &'a Value,
    canonical: Option<&'a str>,
}

impl<'a> From<&'a Value> for CallArgs<'a> {
    fn from(value: &'a Value) -> Self {
        CallArgs { value, canonical: None }
    }
}

impl<'a> CallArgs<'a> {
    /// `value` with `canonical`, which must be `json::canonical(value)`: the schema checks
    /// `value` and the guest reads `canonical`, so the two must be the same arguments.
    pub(crate) fn with_canonical(value: &'a Value, canonical: &'a str) -> Self {
        CallArgs { value, canonical: Some(canonical) }
    }

    pub fn value(&self) -> &'a Value {
        self.value
    }

    /// The canonical text, printed only if the caller did not bring it.
    pub fn canonical(&self) -> Cow<'a, str> {
        match self.canonical {
            Some(text) => Cow::Borrowed(text),
            None => Cow::Owned(crate::json::canonical(self.value)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_text_a_caller_brings_is_used_as_it_is_and_otherwise_printed() {
        let value = json!({"b": 2.0, "a": [1, "x"]});
        let printed = crate::json::canonical(&value);
        assert_eq!(printed, r#"{"a":[1,"x"],"b":2}"#);
        let brought = CallArgs::with_canonical(&value, &printed);
        // Borrowed, the very same text: the arguments were not printed again.
        assert!(matches!(brought.canonical(), Cow::Borrowed(text) if std::ptr::eq(text, printed.as_str())));
        assert!(matches!(CallArgs::from(&value).canonical(), Cow::Owned(text) if text == printed));
        assert!(std::ptr::eq(brought.value(), &value));
    }
}
