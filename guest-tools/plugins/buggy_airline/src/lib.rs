//! `buggy_airline`: the bundled airline with a deliberately wrong compensator. Its `cancel`
//! deletes the reservation but never gives the seats back, the bug of a public airline
//! benchmark's `cancel_reservation`. `sagabox verify` must catch it.

use sagabox_toolkit::airline::{self, Airline};
use sagabox_toolkit::{Context, Plugin, Store, ToolError, ToolSpec, Value};

pub struct BuggyAirline;

impl Plugin for BuggyAirline {
    fn manifest() -> Vec<ToolSpec> {
        Airline::manifest()
            .into_iter()
            .map(|mut spec| {
                if spec.name == "cancel" {
                    spec.description = "Cancels a reservation (deliberately buggy: the seats are never given back).";
                }
                spec
            })
            .collect()
    }

    fn call(store: &mut dyn Store, tool: &str, args: &Value, ctx: &Context) -> Result<Value, ToolError> {
        match tool {
            "cancel" => airline::cancel(store, args, false),
            other => Airline::call(store, other, args, ctx),
        }
    }
}

sagabox_toolkit::export_plugin!(BuggyAirline, "../../../wit");
