//! The fixture loader: `State::from_json` (what `store::fixture::load` feeds every fixture
//! through), and the state's JSON, canonical text and digest, which must survive a round trip.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sagabox::json::canonical;
use sagabox::store::State;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<Value>(data) else { return };
    let Ok(state) = State::from_json(&value) else {
        assert!(!is_fixture_shaped(&value), "a fixture-shaped value was refused");
        return;
    };
    assert!(is_fixture_shaped(&value));
    let json = state.to_json();
    let again = State::from_json(&json).expect("a state's JSON loads");
    assert_eq!(again.digest(), state.digest(), "the digest changed over a round trip");
    assert_eq!(again.to_canonical_json(), state.to_canonical_json());
    assert_eq!(state.to_canonical_json(), canonical(&json), "the hand-written canonical text differs");
    let count: usize = value.as_object().unwrap().values().map(|d| d.as_object().unwrap().len()).sum();
    assert_eq!(state.doc_count(), count);
});

fn is_fixture_shaped(value: &Value) -> bool {
    value.as_object().is_some_and(|namespaces| namespaces.values().all(Value::is_object))
}
