//! Plugin policies (`runtime::policy::Policy::parse`): never a panic; the limits a policy
//! lays over the defaults are checked without panicking; a parsed policy written back as TOML
//! parses to the same policy.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use sagabox::runtime::policy::{Limits, Policy};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(policy) = Policy::parse(text, Some(Path::new("/plugins"))) else { return };
    let limits = Limits::default().with(&policy.limits);
    if limits.check().is_ok() {
        let _ = (limits.deadline(), limits.memory_bytes(), limits.stack_bytes(), limits.output_bytes());
        let _ = limits.write_quota();
    }
    for dir in &policy.wasi.dirs {
        assert!(dir.host.is_absolute(), "a relative directory grant was not resolved: {:?}", dir.host);
    }
    let ns = policy.store.write.first().cloned().unwrap_or_default();
    assert!(!policy.store.can_write(&ns) || policy.store.can_read(&ns), "a writable namespace is not readable");
    if let Ok(written) = toml::to_string(&policy) {
        let again = Policy::parse(&written, None).unwrap_or_else(|e| panic!("{e}\n{written}"));
        assert_eq!(again, policy, "the policy changed over a TOML round trip");
    }
});
