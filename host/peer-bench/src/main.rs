//! CT1 (flight, hotel, payment declined, hotel and flight cancelled) on steno, the saga
//! executor of Oxide's control plane, with the bundled tools' logic called natively on an
//! in-memory map: what a Rust shop would write today without sagabox. Prints sagas per
//! second, one at a time and 64 in flight, to set beside `sagabox bench --only sagas`.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use sagabox_toolkit::{Context, MapStore, NativePlugin, native_plugin};
use serde_json::{Value, json};
use steno::{
    ActionContext, ActionError, ActionFunc, ActionRegistry, DagBuilder, InMemorySecStore, Node, SagaDag, SagaId,
    SagaName, SagaType,
};

/// Documents by (namespace, key), as JSON text (the tools exchange text, as in the sandbox).
type Docs = MapStore;

#[derive(Debug)]
struct Trip {
    docs: Mutex<Docs>,
    input: Value,
}

#[derive(Debug)]
struct Ct1;
impl SagaType for Ct1 {
    type ExecContextType = Arc<Trip>;
}

/// Calls a tool natively; an error becomes a steno action error.
fn call(trip: &Trip, plugin: &str, tool: &str, args: &Value, key: &str) -> Result<Value, String> {
    let NativePlugin { call, .. } = native_plugin(plugin).ok_or("no such plugin")?;
    let ctx = Context { saga_id: "peer".into(), step_id: tool.into(), attempt: 1, idempotency_key: key.into() };
    let mut docs = trip.docs.lock().map_err(|e| e.to_string())?;
    call(&mut *docs, tool, args, &ctx).map_err(|e| format!("{e:?}"))
}

/// A boxed action or undo future, as steno's `ActionFunc` takes them.
type Boxed<T> = std::pin::Pin<Box<dyn Future<Output = T> + Send>>;

fn forward(
    plugin: &'static str,
    tool: &'static str,
    input: &'static str,
) -> impl Fn(ActionContext<Ct1>) -> Boxed<Result<Value, ActionError>> {
    move |cx: ActionContext<Ct1>| {
        Box::pin(async move {
            let trip = cx.user_data().clone();
            let mut args = trip.input[input].clone();
            if tool == "charge" {
                let hotel: Value = cx.lookup("hotel")?;
                args["amount"] = hotel["total_price"].clone();
            }
            call(&trip, plugin, tool, &args, &format!("{plugin}-{tool}-key-000000"))
                .map_err(|e| ActionError::action_failed(json!({ "error": e })))
        })
    }
}

fn undo(
    plugin: &'static str,
    tool: &'static str,
    node: &'static str,
) -> impl Fn(ActionContext<Ct1>) -> Boxed<Result<(), anyhow::Error>> {
    move |cx: ActionContext<Ct1>| {
        Box::pin(async move {
            let trip = cx.user_data().clone();
            let output: Value = cx.lookup(node)?;
            let args = json!({ "forward": { "output": output } });
            call(&trip, plugin, tool, &args, "undo").map(|_| ()).map_err(anyhow::Error::msg)
        })
    }
}

fn registry() -> (Arc<ActionRegistry<Ct1>>, Arc<SagaDag>) {
    let flight =
        ActionFunc::new_action("flight", forward("airline", "book", "flight"), undo("airline", "cancel", "flight"));
    let hotel = ActionFunc::new_action("hotel", forward("hotel", "reserve", "hotel"), undo("hotel", "cancel", "hotel"));
    let payment = ActionFunc::new_action(
        "payment",
        forward("payment", "charge", "payment"),
        undo("payment", "refund", "payment"),
    );
    let mut registry = ActionRegistry::new();
    let mut builder = DagBuilder::new(SagaName::new("ct1"));
    builder.append(Node::action("flight", "BookFlight", flight.as_ref()));
    builder.append(Node::action("hotel", "BookHotel", hotel.as_ref()));
    builder.append(Node::action("payment", "Pay", payment.as_ref()));
    registry.register(flight);
    registry.register(hotel);
    registry.register(payment);
    let dag = Arc::new(SagaDag::new(builder.build().expect("a valid DAG"), json!({})));
    (Arc::new(registry), dag)
}

fn load(path: &str) -> anyhow::Result<Value> {
    Ok(serde_json::from_str(&std::fs::read_to_string(path)?)?)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let sagas_dir = std::env::args().nth(1).unwrap_or_else(|| "sagas".into());
    let fixture = load(&format!("{sagas_dir}/ct1-payment-failure.fixture.json"))?;
    let input = load(&format!("{sagas_dir}/ct1-payment-failure.input.json"))?;
    let mut docs = Docs::default();
    for (ns, entries) in fixture.as_object().into_iter().flatten() {
        for (key, doc) in entries.as_object().into_iter().flatten() {
            docs.0.insert((ns.clone(), key.clone()), doc.to_string());
        }
    }
    let log = slog::Logger::root(slog::Discard, slog::o!());
    let sec = Arc::new(steno::sec(log, Arc::new(InMemorySecStore::new())));
    let (registry, dag) = registry();
    let total: usize = std::env::var("PEER_SAGAS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    for concurrency in [1usize, 2, 64] {
        let started = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..concurrency {
            let (sec, registry, dag, docs, input) =
                (sec.clone(), registry.clone(), dag.clone(), docs.clone(), input.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..total / concurrency {
                    let trip = Arc::new(Trip { docs: Mutex::new(docs.clone()), input: input.clone() });
                    let id = SagaId::new_v4();
                    let done = sec.saga_create(id, Arc::new(trip.clone()), dag.clone(), registry.clone()).await?;
                    sec.saga_start(id).await?;
                    let result = done.await;
                    anyhow::ensure!(result.kind.is_err(), "CT1 must fail at the payment");
                    let restored = trip.docs.lock().map_err(|e| anyhow::anyhow!("{e}"))?;
                    anyhow::ensure!(restored.0.len() == docs.0.len(), "the rollback left documents behind");
                }
                Ok::<_, anyhow::Error>(())
            }));
        }
        for task in tasks {
            task.await??;
        }
        let per_second = (total / concurrency * concurrency) as f64 / started.elapsed().as_secs_f64();
        println!("steno ct1-payment-failure, native tools, {concurrency} in flight: {per_second:.0} sagas/s");
    }
    Ok(())
}
