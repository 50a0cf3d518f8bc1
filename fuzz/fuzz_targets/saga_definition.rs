//! Saga files: parsing (`definition::parse`) and validation against the bundled plugins
//! (`Saga::from_text`, which builds the plan). Never a panic; a saga that validates has a
//! consistent plan.
#![no_main]

use std::path::Path;
use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use sagabox::runtime::{Runtime, RuntimeOptions};
use sagabox::saga::{Saga, definition};

/// The bundled plugins, loaded once per process, before fuzzing starts. Their compiled form
/// is cached under `fuzz/target/`, so only the first process of a build compiles them.
static RUNTIME: LazyLock<Runtime> = LazyLock::new(|| {
    let cache = concat!(env!("CARGO_MANIFEST_DIR"), "/target/plugin-cache");
    let options = RuntimeOptions { cache_dir: Some(cache.into()), ..RuntimeOptions::default() };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio");
    rt.block_on(Runtime::load(options)).expect("the bundled plugins load")
});

fuzz_target!(init: { LazyLock::force(&RUNTIME); }, |data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let path = Path::new("/nonexistent/fuzz.json");
    let Ok(def) = definition::parse(text, path) else { return };
    let steps = def.steps.len();
    let Ok(saga) = Saga::from_text(text, path, &RUNTIME) else { return };
    let plan = &saga.plan;
    assert_eq!(plan.steps.len(), steps, "a valid saga plans every step");
    for (i, step) in plan.steps.iter().enumerate() {
        assert_eq!(plan.step(&step.id).map(|(j, _)| j), Some(i), "step '{}' is found by its id", step.id);
        for &d in &step.deps {
            assert!(d < steps && d != i, "step '{}' depends on #{d}", step.id);
        }
        assert!(step.retry.max_attempts >= 1, "step '{}' runs at least once", step.id);
    }
    assert!(plan.compensation_retry.max_attempts >= 1);
});
