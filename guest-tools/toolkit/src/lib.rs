//! The logic of sagabox's bundled tools, written against a small [`Store`] trait so that the
//! same code runs inside a WebAssembly component (through the `sagabox:plugin` WIT imports)
//! and natively (the host's benchmarks compare the two).
//!
//! Every side-effecting tool derives the ids of the records it creates from the call's
//! idempotency key, so a second delivery of the same call finds its own record and changes
//! nothing, and a compensator can find the effect of a call whose reply was lost.

pub mod agents;
pub mod airline;
pub mod call_heap;
mod common;
pub mod docs;
pub mod hotel;
pub mod inventory;
pub mod json_text;
pub mod mem;
pub mod payment;
pub mod rental;
pub mod resources;
pub mod shipping;
pub mod taubench;
pub mod taubench_airline;
pub mod taubench_retail;

pub use common::{
    Args, Context, FieldIs, MapStore, Plugin, Store, StoreErrorKind, StoreExt, ToolError, ToolSpec, compensator_schema,
    find_by_reading, to_json,
};
pub use serde_json::{Value, json};

/// The bundled plugins by name, for hosts that run them natively.
pub fn native_plugin(name: &str) -> Option<NativePlugin> {
    Some(match name {
        "agents" => NativePlugin::of::<agents::Agents>(),
        "airline" => NativePlugin::of::<airline::Airline>(),
        "hotel" => NativePlugin::of::<hotel::Hotel>(),
        "inventory" => NativePlugin::of::<inventory::Inventory>(),
        "payment" => NativePlugin::of::<payment::Payment>(),
        "rental" => NativePlugin::of::<rental::Rental>(),
        "resources" => NativePlugin::of::<resources::Resources>(),
        "shipping" => NativePlugin::of::<shipping::Shipping>(),
        "taubench_airline" => NativePlugin::of::<taubench_airline::TaubenchAirline>(),
        "taubench_retail" => NativePlugin::of::<taubench_retail::TaubenchRetail>(),
        _ => return None,
    })
}

/// A plugin's two entry points as plain function pointers.
#[derive(Clone, Copy)]
pub struct NativePlugin {
    pub manifest: fn() -> Vec<ToolSpec>,
    pub call: fn(&mut dyn Store, &str, &Value, &Context) -> Result<Value, ToolError>,
}

impl NativePlugin {
    fn of<P: Plugin>() -> Self {
        NativePlugin { manifest: P::manifest, call: P::call }
    }
}

/// Exports a [`Plugin`] as a `sagabox:plugin` component. Use it once, at the root of a
/// `cdylib` crate that depends on `wit-bindgen`; `$wit` is the path of `wit/` relative to
/// that crate.
#[macro_export]
macro_rules! export_plugin {
    ($plugin:ty, $wit:literal) => {
        ::wit_bindgen::generate!({ path: $wit, world: "plugin" });

        // Each instance serves one call, on one thread (see `call_heap`).
        #[cfg(all(target_family = "wasm", not(target_feature = "atomics")))]
        #[global_allocator]
        static CALL_HEAP: $crate::call_heap::CallHeap = $crate::call_heap::CallHeap::new();

        /// Replaces wit-bindgen's (weak) `cabi_realloc`, which allocates with the global
        /// allocator: with WASI, wasi-libc frees with `free` what it receives through it
        /// (`call_heap::cabi_realloc` says where each target's blocks come from).
        #[cfg(all(target_family = "wasm", not(target_feature = "atomics")))]
        #[unsafe(export_name = "cabi_realloc")]
        unsafe extern "C" fn cabi_realloc(block: *mut u8, old_size: usize, align: usize, new_size: usize) -> *mut u8 {
            // SAFETY: the canonical ABI calls it as `realloc`, which is `call_heap::cabi_realloc`'s contract.
            unsafe { $crate::call_heap::cabi_realloc(block, old_size, align, new_size) }
        }

        /// Compares eight bytes at a time where the standard library's WebAssembly builds
        /// compare one (`mem`): every string comparison a plugin makes ends here.
        #[cfg(target_family = "wasm")]
        #[unsafe(no_mangle)]
        unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
            // SAFETY: C's `memcmp` contract, which is `mem::compare`'s.
            unsafe { $crate::mem::compare(a, b, n) }
        }

        /// Without WASI the standard library prints a panic's message nowhere.
        fn on_panic_report_to_stderr() {
            #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
            ::std::panic::set_hook(::std::boxed::Box::new($crate::report_panic));
        }

        use exports::sagabox::plugin::tool as wit_tool;
        use sagabox::plugin::store as wit_store;

        /// The host's store, seen through the toolkit's trait.
        struct HostStore;

        fn store_error(error: wit_store::StoreError) -> $crate::ToolError {
            use $crate::StoreErrorKind as K;
            match error {
                wit_store::StoreError::InvalidDocument(m) => $crate::ToolError::from_store(K::InvalidDocument, m),
                wit_store::StoreError::QuotaExceeded(m) => $crate::ToolError::from_store(K::QuotaExceeded, m),
                wit_store::StoreError::Unavailable(m) => $crate::ToolError::from_store(K::Unavailable, m),
            }
        }

        impl $crate::Store for HostStore {
            fn get(&mut self, ns: &str, key: &str) -> Result<Option<String>, $crate::ToolError> {
                wit_store::get(ns, key).map_err(store_error)
            }
            fn put(&mut self, ns: &str, key: &str, doc: &str) -> Result<(), $crate::ToolError> {
                wit_store::put(ns, key, doc).map_err(store_error)
            }
            fn delete(&mut self, ns: &str, key: &str) -> Result<bool, $crate::ToolError> {
                wit_store::delete(ns, key).map_err(store_error)
            }
            fn list(&mut self, ns: &str, prefix: &str) -> Result<Vec<String>, $crate::ToolError> {
                wit_store::list(ns, prefix).map_err(store_error)
            }
            fn find(
                &mut self,
                ns: &str,
                prefix: &str,
                conditions: &[$crate::FieldIs],
            ) -> Result<Vec<(String, String)>, $crate::ToolError> {
                let conditions: Vec<wit_store::FieldIs> = conditions
                    .iter()
                    .map(|c| wit_store::FieldIs { path: c.path.clone(), value: c.value.clone() })
                    .collect();
                wit_store::find(ns, prefix, &conditions).map_err(store_error)
            }
        }

        struct Shell;

        impl wit_tool::Guest for Shell {
            fn manifest() -> Vec<wit_tool::ToolInfo> {
                on_panic_report_to_stderr();
                <$plugin as $crate::Plugin>::manifest()
                    .into_iter()
                    .map(|spec| wit_tool::ToolInfo {
                        name: spec.name.to_string(),
                        description: spec.description.to_string(),
                        args_schema: $crate::to_json(&spec.schema),
                        compensator: spec.compensator.map(str::to_string),
                        side_effects: spec.side_effects,
                    })
                    .collect()
            }

            fn call(
                name: String,
                args: String,
                context: wit_tool::CallContext,
            ) -> Result<String, wit_tool::ToolError> {
                on_panic_report_to_stderr();
                let ctx = $crate::Context {
                    saga_id: context.saga_id,
                    step_id: context.step_id,
                    attempt: context.attempt,
                    idempotency_key: context.idempotency_key,
                };
                let outcome = $crate::parse_args(&args)
                    .and_then(|args| <$plugin as $crate::Plugin>::call(&mut HostStore, &name, &args, &ctx));
                match outcome {
                    Ok(value) => Ok($crate::to_json(&value)),
                    Err($crate::ToolError::InvalidInput(m)) => Err(wit_tool::ToolError::InvalidInput(m)),
                    Err($crate::ToolError::Rejected(m)) => Err(wit_tool::ToolError::Rejected(m)),
                    Err($crate::ToolError::Transient(m)) => Err(wit_tool::ToolError::Transient(m)),
                }
            }
        }

        export!(Shell);
    };
}

/// Writes a panic's message to WASI's stderr, as the standard library does on
/// `wasm32-wasip2`: the host keeps a guest's first stderr bytes for the trap's message. The
/// hook itself formats on the stack, adding no allocation to a panic raised inside the
/// allocator (whose message is a static string, which the standard library does not copy).
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
pub fn report_panic(info: &std::panic::PanicHookInfo<'_>) {
    use std::fmt::Write as _;
    let mut message = StackText { bytes: [0; 4096], len: 0 };
    let _ = writeln!(message, "{info}");
    let stderr = wasip2::cli::stderr::get_stderr();
    // 4,096 bytes: one write's most, and as much as the host keeps.
    let _ = stderr.blocking_write_and_flush(&message.bytes[..message.len]);
}

/// Text in a fixed buffer, cut where it is full.
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
struct StackText {
    bytes: [u8; 4096],
    len: usize,
}

#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
impl std::fmt::Write for StackText {
    fn write_str(&mut self, text: &str) -> std::fmt::Result {
        let room = self.bytes.len() - self.len;
        let taken = text.len().min(room);
        self.bytes[self.len..self.len + taken].copy_from_slice(&text.as_bytes()[..taken]);
        self.len += taken;
        if taken < text.len() { Err(std::fmt::Error) } else { Ok(()) }
    }
}

/// Parses a call's JSON arguments.
pub fn parse_args(text: &str) -> Result<Value, ToolError> {
    serde_json::from_str(text).map_err(|e| ToolError::InvalidInput(format!("arguments are not JSON: {e}")))
}
