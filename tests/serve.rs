//! `sagabox serve` driven by real MCP clients: the official MCP Python SDK (`mcp==2.3.0`,
//! the scripts of tests/mcp/) over stdio and Streamable HTTP, with the legacy protocol
//! (initialize; over HTTP, an Mcp-Session-Id session) and the modern one (2026-07-28,
//! stateless), and the LangGraph example (examples/langgraph/). Each script checks what the
//! client sees and prints a JSON summary; the tests check that summary and the store
//! (`sagabox state --db F --digest`, `sagabox runs --db F --json`). The Python venvs are made
//! on first use (tests/support/python.rs).

use crate::support;

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{python, sagas_dir, shared_cache};

const FIXTURE: &str = "ct1-payment-failure.fixture.json";
const MODERN: &str = "2026-07-28";
/// One scenario script, server start-up (and, the first time, plugin compilation) included.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Transport {
    /// The SDK spawns `sagabox serve` and picks the protocol (`mode="auto"`: modern).
    Stdio,
    StdioLegacy,
    /// `--http`: initialize, then an Mcp-Session-Id session.
    HttpLegacy,
    /// `--http`, 2026-07-28: stateless; transactions are named in every call.
    HttpModern,
}
use Transport::*;

/// The transports every transaction scenario runs over.
const TRANSPORTS: [Transport; 3] = [Stdio, HttpLegacy, HttpModern];

impl Transport {
    fn mode(self) -> &'static str {
        match self {
            Stdio => "auto",
            StdioLegacy | HttpLegacy => "legacy",
            HttpModern => MODERN,
        }
    }
}

/// Runs the `sagabox` command line and returns its stdout; panics when it fails.
fn cli(args: &[&str]) -> String {
    let out = support::sagabox(args);
    assert!(out.status.success(), "sagabox {args:?}: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn fixture_digest() -> &'static str {
    static DIGEST: OnceLock<String> = OnceLock::new();
    DIGEST.get_or_init(|| {
        cli(&["state", "--state", sagas_dir().join(FIXTURE).to_str().unwrap(), "--digest"]).trim().to_string()
    })
}

/// A database, seeded by the server from `fixture`, in a directory of its own (for SQLite,
/// the file; logs either way).
struct Store {
    dir: tempfile::TempDir,
    db: String,
    fixture: String,
    /// The PostgreSQL schema that `db` names, if it is one.
    _schema: Option<support::postgres::Schema>,
}

impl Store {
    fn new() -> Store {
        Store::from_fixture(sagas_dir().join(FIXTURE))
    }

    /// A store seeded with `state` (canonical JSON of namespaces).
    fn with_state(state: &Value) -> Store {
        let dir = tempfile::tempdir().unwrap();
        let fixture = dir.path().join("fixture.json");
        std::fs::write(&fixture, state.to_string()).unwrap();
        Store::in_dir(dir, fixture)
    }

    fn from_fixture(fixture: PathBuf) -> Store {
        Store::in_dir(tempfile::tempdir().unwrap(), fixture)
    }

    fn in_dir(dir: tempfile::TempDir, fixture: PathBuf) -> Store {
        let db = dir.path().join("store.db").to_str().unwrap().to_string();
        Store { dir, db, fixture: fixture.to_str().unwrap().to_string(), _schema: None }
    }

    /// A store in a PostgreSQL schema of its own, seeded from the usual fixture.
    fn postgres(tag: &str) -> Store {
        let schema = support::postgres::Schema::new(tag);
        Store { db: schema.url.clone(), _schema: Some(schema), ..Store::new() }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_str().unwrap().to_string()
    }

    fn serve_args(&self) -> Vec<String> {
        ["serve", "--db", &self.db, "--state", &self.fixture].map(String::from).to_vec()
    }

    fn digest(&self) -> String {
        cli(&["state", "--db", &self.db, "--digest"]).trim().to_string()
    }

    fn state(&self) -> Value {
        serde_json::from_str(&cli(&["state", "--db", &self.db])).unwrap()
    }

    fn runs(&self) -> Vec<Value> {
        serde_json::from_str(&cli(&["runs", "--db", &self.db, "--json"])).unwrap()
    }

    /// The run of `transaction`; panics, listing the runs, when there is none.
    fn run(&self, transaction: &Value) -> Value {
        let runs = self.runs();
        let found = runs.iter().find(|r| &r["run_id"] == transaction).cloned();
        found.unwrap_or_else(|| panic!("no run {transaction} in {runs:#?}"))
    }

    /// Waits until the store's digest is `expected`; panics after `within`.
    fn wait_for_digest(&self, expected: &str, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let digest = self.digest();
            if digest == expected {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the store's digest is still {digest}, not {expected}, after {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A run that is over: neither still running nor lost.
fn assert_finished(run: &Value) {
    assert!(run["status"].is_string() && run["status"] != "running", "the run is not finished: {run:#}");
}

/// The seats left in economy on HAT001 on 2024-05-16, and the rooms left at NYC-GRAND that night.
fn seats_and_rooms(state: &Value) -> (i64, i64) {
    let seats = &state["flights"]["HAT001"]["dates"]["2024-05-16"]["available_seats"]["economy"];
    let rooms = &state["hotels"]["NYC-GRAND"]["dates"]["2024-05-16"]["rooms_available"];
    (seats.as_i64().unwrap(), rooms.as_i64().unwrap())
}

/// The keys that namespace `name` has and the fixture's has not.
fn added(state: &Value, name: &str) -> BTreeSet<String> {
    static FIXTURE_STATE: OnceLock<Value> = OnceLock::new();
    let fixture = FIXTURE_STATE
        .get_or_init(|| serde_json::from_str(&std::fs::read_to_string(sagas_dir().join(FIXTURE)).unwrap()).unwrap());
    let keys = |state: &Value| -> BTreeSet<String> {
        state.get(name).and_then(Value::as_object).map(|o| o.keys().cloned().collect()).unwrap_or_default()
    };
    keys(state).difference(&keys(fixture)).cloned().collect()
}

/// `sagabox serve --http` on a free loopback port, logging to a file of its store's
/// directory; killed (SIGKILL) when dropped, its log then printed for a failing test.
struct Server {
    child: Child,
    url: String,
    log: String,
}

impl Server {
    fn start(store: &Store, extra: &[&str]) -> Server {
        Server::launch(store, store.serve_args(), extra)
    }

    /// A server joining a store another one seeded (so without `--state`).
    fn join(store: &Store) -> Server {
        Server::launch(store, ["serve", "--db", &store.db].map(String::from).to_vec(), &[])
    }

    fn launch(store: &Store, serve_args: Vec<String>, extra: &[&str]) -> Server {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap().local_addr().unwrap().port();
        let address = format!("127.0.0.1:{port}");
        let log = store.path(&format!("serve-{port}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_sagabox"))
            .args(serve_args)
            .args(extra)
            .args(["--http", &address])
            .env("SAGABOX_CACHE_DIR", shared_cache())
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("sagabox serve starts");
        let mut server = Server { child, url: format!("http://{address}/mcp"), log };
        let deadline = Instant::now() + Duration::from_secs(120);
        while TcpStream::connect(&address).is_err() {
            if let Some(status) = server.child.try_wait().unwrap() {
                panic!("sagabox serve --http {address} exited: {status}\n{}", server.log_text());
            }
            assert!(Instant::now() < deadline, "sagabox serve does not listen on {address}\n{}", server.log_text());
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL, as a crash.
    fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        eprintln!("--- sagabox serve at {} ---\n{}", self.url, self.log_text());
    }
}

/// A store served over one transport; over HTTP the test owns the server.
struct Served {
    transport: Transport,
    server: Option<Server>,
    store: Store,
    extra: Vec<String>,
}

impl Served {
    fn start(transport: Transport, store: Store, extra: &[&str]) -> Served {
        let server = matches!(transport, HttpLegacy | HttpModern).then(|| Server::start(&store, extra));
        Served { transport, server, store, extra: extra.iter().map(|s| s.to_string()).collect() }
    }

    /// Runs tests/mcp/`name` (the SDK spawns the server itself over stdio) and returns its summary.
    fn script(&self, name: &str, args: &[&str]) -> Value {
        self.script_via(self.server.as_ref(), name, args)
    }

    /// [`Served::script`] against `server` (another server of the same store, say).
    fn script_via(&self, server: Option<&Server>, name: &str, args: &[&str]) -> Value {
        let mut command = python::script(&python::venv(), &python::workspace().join("tests/mcp").join(name));
        command.args(args).args(["--mode", self.transport.mode()]);
        match server {
            Some(server) => command.args(["--url", &server.url]),
            None => {
                command.arg("--").arg(env!("CARGO_BIN_EXE_sagabox")).args(self.store.serve_args()).args(&self.extra)
            }
        };
        python::run(&mut command, SCRIPT_TIMEOUT).json()
    }

    fn server(&mut self) -> &mut Server {
        self.server.as_mut().expect("an HTTP transport")
    }
}

/// `plugin__tool` -> the tool's manifest entry, for every tool of every loaded plugin.
fn manifests() -> Vec<(String, Value, bool)> {
    let plugins: Vec<Value> = serde_json::from_str(&cli(&["plugins", "--json"])).unwrap();
    let mut tools = Vec::new();
    for plugin in &plugins {
        let listed = plugin["tools"].as_array().unwrap();
        for tool in listed {
            let compensator = listed.iter().any(|t| t["compensator"] == tool["name"]);
            let name = format!("{}__{}", plugin["name"].as_str().unwrap(), tool["name"].as_str().unwrap());
            tools.push((name, tool["args_schema"].clone(), compensator));
        }
    }
    tools
}

/// The plugin tools of `listed` are those of the manifests (compensators only when exposed),
/// each with the manifest's properties and required list, plus an optional `transaction`.
fn assert_schemas_match_manifests(listed: &Value, exposed: bool) {
    let listed = listed.as_object().unwrap();
    let expected: Vec<_> = manifests().into_iter().filter(|(_, _, compensator)| exposed || !compensator).collect();
    let served: BTreeSet<&String> = listed.keys().filter(|name| name.contains("__")).collect();
    assert_eq!(served, expected.iter().map(|(name, _, _)| name).collect(), "the plugin tools served");
    for (name, manifest, _) in &expected {
        let schema = &listed[name]["inputSchema"];
        let mut properties = schema["properties"].as_object().unwrap().clone();
        let transaction = properties.remove("transaction");
        assert_eq!(transaction.and_then(|t| t.get("type").cloned()), Some(json!("string")), "{name}'s transaction");
        assert_eq!(Value::Object(properties), manifest["properties"], "{name}'s properties");
        assert_eq!(schema.get("required"), manifest.get("required"), "{name}'s required properties");
    }
}

#[test]
fn tools_are_listed_with_their_schemas_and_annotations() {
    for transport in [Stdio, StdioLegacy, HttpLegacy, HttpModern] {
        let served = Served::start(transport, Store::new(), &[]);
        let listed = served.script("list_tools.py", &[]);
        assert_eq!(listed["protocol"] == MODERN, transport.mode() != "legacy", "{transport:?}: {}", listed["protocol"]);
        assert_schemas_match_manifests(&listed["tools"], false);
    }
    let sagas = sagas_dir();
    let served = Served::start(Stdio, Store::new(), &["--expose-compensators", "--sagas", sagas.to_str().unwrap()]);
    let listed =
        served.script("list_tools.py", &["--expose-compensators", "--expect-tool", "saga_ct1-payment-failure"]);
    assert_schemas_match_manifests(&listed["tools"], true);
}

#[test]
fn a_declined_charge_rolls_the_session_back() {
    for transport in TRANSPORTS {
        let served = Served::start(transport, Store::new(), &[]);
        let out = served.script("declined_charge.py", &[]);
        assert_eq!(out["compensated"], json!(["hotel__reserve", "airline__book"]), "{transport:?}");
        assert_eq!(served.store.digest(), fixture_digest(), "{transport:?}: the store is not the fixture again");
        let run = served.store.run(&out["transaction"]);
        assert!(run["saga"].as_str().unwrap().starts_with("session:"), "{transport:?}: {run:#}");
        assert_finished(&run);
    }
}

#[test]
fn saga_abort_compensates_the_transaction() {
    for transport in TRANSPORTS {
        let served = Served::start(transport, Store::new(), &[]);
        let out = served.script("explicit_abort.py", &[]);
        assert_eq!(out["compensated"], json!(["hotel__reserve", "airline__book"]), "{transport:?}");
        assert_eq!(served.store.digest(), fixture_digest(), "{transport:?}: the store is not the fixture again");
        let run = served.store.run(&out["transaction"]);
        assert_eq!(run["saga"], "session:abort-demo", "{transport:?}");
        assert_finished(&run);
    }
}

#[test]
fn saga_commit_keeps_its_effects_through_a_later_failure() {
    for transport in TRANSPORTS {
        let served = Served::start(transport, Store::new(), &[]);
        let out = served.script("commit_keeps.py", &[]);
        assert_ne!(served.store.digest(), fixture_digest(), "{transport:?}: the committed bookings are gone");
        let state = served.store.state();
        assert_eq!(seats_and_rooms(&state), (8, 2), "{transport:?}: one seat and one room stay booked");
        let kept = |name: &str| BTreeSet::from([out["kept"][name].as_str().unwrap().to_string()]);
        assert_eq!(added(&state, "reservations"), kept("flight"), "{transport:?}: only the committed flight stays");
        assert_eq!(added(&state, "hotel_bookings"), kept("hotel"), "{transport:?}");
        assert!(added(&state, "payments").is_empty(), "{transport:?}: a declined charge was recorded");
        for transaction in [&out["committed"], &out["rolled_back"]] {
            assert_finished(&served.store.run(transaction));
        }
    }
}

#[test]
fn a_client_that_goes_away_is_rolled_back() {
    for transport in TRANSPORTS {
        let served = Served::start(transport, Store::new(), &[]);
        // Stdio: the client exits, closing the server's stdin; legacy HTTP: it deletes its
        // session; modern HTTP has no session, so the transaction's own timeout ends it.
        let args: &[&str] = if transport == HttpModern { &["--timeout", "3s"] } else { &[] };
        let out = served.script("walk_away.py", args);
        served.store.wait_for_digest(fixture_digest(), Duration::from_secs(30));
        let deadline = Instant::now() + Duration::from_secs(30);
        while served.store.run(&out["transaction"])["status"] == "running" && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_finished(&served.store.run(&out["transaction"]));
    }
}

#[test]
fn resume_compensates_what_a_killed_server_left_open() {
    let mut served = Served::start(HttpModern, Store::new(), &[]);
    let out = served.script("walk_away.py", &[]);
    let (store, transaction) = (&served.store, &out["transaction"]);
    assert_ne!(store.digest(), fixture_digest(), "the open transaction's bookings are not in the store");
    assert_eq!(store.run(transaction)["status"], "running");

    served.server().kill();
    let store = &served.store;
    assert_eq!(seats_and_rooms(&store.state()), (8, 2), "a SIGKILL lost committed steps");
    let resumed = support::sagabox(&["resume", "--db", &store.db]);
    assert!(resumed.status.success(), "resume: {}", String::from_utf8_lossy(&resumed.stderr));
    assert_eq!(store.digest(), fixture_digest(), "resume did not compensate the open transaction");
    assert_finished(&store.run(transaction));

    let runs = store.runs();
    let again = support::sagabox(&["resume", "--db", &store.db]);
    assert!(again.status.success(), "resume again: {}", String::from_utf8_lossy(&again.stderr));
    assert_eq!(String::from_utf8_lossy(&again.stdout).trim(), "", "a second resume did something");
    assert_eq!(store.runs(), runs, "a second resume changed the runs");
    assert_eq!(store.digest(), fixture_digest());
}

#[test]
fn servers_sharing_one_postgres_keep_every_session_and_a_worker_undoes_a_dead_servers() {
    // Two servers on one database, as behind a load balancer.
    let mut first = Served::start(HttpModern, Store::postgres("serve"), &[]);
    let second = Server::join(&first.store);
    let committed = first.script_via(Some(&second), "idempotent_retry.py", &[]);
    let store = &first.store;
    let after_commit = store.digest();
    assert_ne!(after_commit, fixture_digest(), "the second server's committed booking is not in the shared store");
    assert_eq!(seats_and_rooms(&store.state()).0, 8);
    // The first server sees it, and leaves a transaction open on top of it.
    let open = first.script("walk_away.py", &[]);
    assert_eq!(store.run(&open["transaction"])["status"], "running");
    assert_eq!(seats_and_rooms(&store.state()), (7, 2), "the open transaction booked on top of the committed one");

    first.server().kill();
    let store = &first.store;
    // A worker (here on the same machine; elsewhere once the lease runs out) takes over the
    // dead server's session and undoes it; the second server's committed one stays.
    let worker = support::sagabox(&["worker", "--db", &store.db, "--until-done", "--lease", "2s"]);
    let log = String::from_utf8_lossy(&worker.stderr);
    assert!(worker.status.success(), "worker: {log}");
    assert!(log.contains("; 0 could not run"), "{log}");
    assert_eq!(store.digest(), after_commit, "the worker did not undo exactly the open transaction");
    assert_finished(&store.run(&open["transaction"]));
    assert_eq!(
        added(&store.state(), "reservations"),
        BTreeSet::from([committed["flight"].as_str().unwrap().to_string()])
    );
}

#[test]
fn concurrent_sessions_roll_back_only_their_own_effects() {
    const SESSIONS: usize = 32;
    // The fixture, with room for every session's booking.
    let mut state: Value = serde_json::from_str(&std::fs::read_to_string(sagas_dir().join(FIXTURE)).unwrap()).unwrap();
    state["flights"]["HAT001"]["dates"]["2024-05-16"]["available_seats"]["economy"] = json!(100);
    state["hotels"]["NYC-GRAND"]["dates"]["2024-05-16"]["rooms_available"] = json!(100);
    let served = Served::start(HttpLegacy, Store::with_state(&state), &[]);
    let out = served.script("many_sessions.py", &["--sessions", &SESSIONS.to_string()]);

    let sessions = out["sessions"].as_array().unwrap();
    assert_eq!(sessions.len(), SESSIONS);
    let committed: Vec<&Value> = sessions.iter().filter(|s| s["outcome"] == "commit").collect();
    let booked = |name: &str| -> BTreeSet<String> {
        committed.iter().map(|s| s["booked"][name].as_str().unwrap().to_string()).collect()
    };
    let state = served.store.state();
    let n = committed.len() as i64;
    assert_eq!(seats_and_rooms(&state), (100 - n, 100 - n), "{n} sessions committed");
    assert_eq!(added(&state, "reservations"), booked("flight"), "the flights left are the committed ones");
    assert_eq!(added(&state, "hotel_bookings"), booked("hotel"), "the hotel bookings left are the committed ones");
    for session in sessions {
        assert_finished(&served.store.run(&session["transaction"]));
    }
}

#[test]
fn an_idempotent_retry_is_replayed_not_run_again() {
    for transport in TRANSPORTS {
        let served = Served::start(transport, Store::new(), &[]);
        let out = served.script("idempotent_retry.py", &[]);
        let state = served.store.state();
        assert_eq!(seats_and_rooms(&state).0, 8, "{transport:?}: the retry booked another seat");
        assert_eq!(added(&state, "reservations"), BTreeSet::from([out["flight"].as_str().unwrap().to_string()]));
    }
}

/// `sagabox journal --as-saga` of a session's transaction, then `sagabox verify` of the saga.
fn export_and_verify(store: &Store, transaction: &Value) -> Output {
    let saga = store.path("session.json");
    cli(&["journal", "--db", &store.db, transaction.as_str().unwrap(), "--as-saga", &saga]);
    let fixture = store.path("session.fixture.json");
    let before = cli(&["state", "--state", &fixture, "--digest"]);
    assert_eq!(before.trim(), fixture_digest(), "the exported fixture is not the store the transaction began with");
    support::sagabox(&["verify", &saga])
}

#[test]
fn a_session_exported_as_a_saga_verifies() {
    let served = Served::start(Stdio, Store::new(), &[]);
    let out = served.script("declined_charge.py", &[]);
    let verified = export_and_verify(&served.store, &out["transaction"]);
    let report = String::from_utf8_lossy(&verified.stdout);
    assert_eq!(verified.status.code(), Some(0), "{report}\n{}", String::from_utf8_lossy(&verified.stderr));
}

#[test]
fn a_buggy_compensator_recorded_in_a_session_fails_verify() {
    let served = Served::start(Stdio, Store::new(), &[]);
    let out = served.script("declined_charge.py", &["--airline", "buggy_airline"]);
    assert_eq!(out["compensated"], json!(["hotel__reserve", "buggy_airline__book"]));
    assert_eq!(seats_and_rooms(&served.store.state()), (8, 3), "the buggy cancel gave the seat back");
    let verified = export_and_verify(&served.store, &out["transaction"]);
    let report = String::from_utf8_lossy(&verified.stdout);
    assert_eq!(verified.status.code(), Some(1), "{report}\n{}", String::from_utf8_lossy(&verified.stderr));
    assert!(report.contains("changed flights/HAT001"), "{report}");
    assert!(report.contains("/dates/2024-05-16/available_seats/economy: 9 -> 8"), "{report}");
}

#[test]
fn the_langgraph_example_reports_the_rolled_back_trip() {
    let store = Store::new();
    let agent = python::workspace().join("examples/langgraph/agent.py");
    let mut command = python::script(&python::langgraph_venv(), &agent);
    command.args(["--json", "--"]).arg(env!("CARGO_BIN_EXE_sagabox")).args(store.serve_args());
    let out = python::run(&mut command, SCRIPT_TIMEOUT).json();
    let calls: Vec<(&str, &str)> = out["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["tool"].as_str().unwrap(), c["status"].as_str().unwrap()))
        .collect();
    assert_eq!(calls, [("airline__book", "success"), ("hotel__reserve", "success"), ("payment__charge", "error")]);
    let answer = out["answer"].as_str().unwrap();
    // sagabox's report, relayed by the agent: the hotel was undone, then the flight.
    let undone = answer.split_once("rolled back: compensated").map(|(_, rest)| rest).unwrap_or_default();
    let (hotel, flight) = (undone.find("hotel"), undone.find("airline"));
    assert!(hotel.is_some() && flight.is_some() && hotel < flight, "{answer}");
    assert_eq!(store.digest(), fixture_digest(), "the agent's trip is still in the store");
}
