//! `sagabox serve` on the wire, byte by byte: what no client SDK would send (malformed and
//! oversized messages, unknown methods and tools), and saga tools with progress. The MCP
//! behaviour agents see is tested with the official Python SDK in `tests/serve.rs`.

use crate::support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{Value, json};

/// `sagabox serve ARGS`, with the tests' shared compile cache.
fn serve(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_sagabox"));
    command.arg("serve").args(args).env("SAGABOX_CACHE_DIR", support::shared_cache());
    command
}

/// A server process, killed when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A server on stdio, with its output lines arriving on a channel.
struct Wire {
    _server: Server,
    input: ChildStdin,
    lines: mpsc::Receiver<Value>,
}

impl Wire {
    fn start(args: &[&str]) -> Wire {
        let mut child = serve(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("sagabox serve starts");
        let input = child.stdin.take().unwrap();
        let output = BufReader::new(child.stdout.take().unwrap());
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in output.lines().map_while(Result::ok) {
                let value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON on stdout ({e}): {line}"));
                if send.send(value).is_err() {
                    break;
                }
            }
        });
        let mut wire = Wire { _server: Server(child), input, lines };
        wire.send_line(
            &json!({ "jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": { "name": "wire", "version": "1" } } })
            .to_string(),
        );
        assert_eq!(wire.next()["id"], 0);
        wire.send_line(&json!({ "jsonrpc": "2.0", "method": "notifications/initialized" }).to_string());
        wire
    }

    fn send_line(&mut self, line: &str) {
        self.input.write_all(line.as_bytes()).unwrap();
        self.input.write_all(b"\n").unwrap();
        self.input.flush().unwrap();
    }

    fn request(&mut self, id: u64, method: &str, params: Value) -> Value {
        self.send_line(&json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params }).to_string());
        self.answer(id)
    }

    /// The next message.
    fn next(&self) -> Value {
        self.lines.recv_timeout(Duration::from_secs(60)).expect("the server answers within 60 s")
    }

    /// The answer to request `id`, skipping notifications.
    fn answer(&self, id: u64) -> Value {
        loop {
            let message = self.next();
            if message["id"] == id {
                return message;
            }
        }
    }
}

#[test]
fn malformed_oversized_and_unknown_requests_get_clear_errors_and_the_next_request_is_served() {
    let mut wire = Wire::start(&[]);
    wire.send_line("{ this is not json");
    let parse = wire.next();
    assert_eq!(parse["error"]["code"], -32700, "{parse}");
    assert_eq!(parse["id"], Value::Null);

    let huge =
        format!("{{\"jsonrpc\":\"2.0\",\"id\":9,\"method\":\"tools/list\",\"pad\":\"{}\"}}", "x".repeat(5 << 20));
    wire.send_line(&huge);
    let oversized = wire.next();
    assert_eq!(oversized["error"]["code"], -32600, "{oversized}");
    assert!(oversized["error"]["message"].as_str().unwrap().contains("4194304 bytes"), "{oversized}");

    let unknown_method = wire.request(1, "tools/frobnicate", json!({}));
    assert_eq!(unknown_method["error"]["code"], -32601, "{unknown_method}");

    let unknown_tool = wire.request(2, "tools/call", json!({ "name": "airline__fly_to_the_moon", "arguments": {} }));
    assert_eq!(unknown_tool["error"]["code"], -32602, "{unknown_tool}");
    assert!(unknown_tool["error"]["message"].as_str().unwrap().contains("airline__book"), "names the served tools");

    let off_schema =
        wire.request(3, "tools/call", json!({ "name": "airline__book", "arguments": { "flight_number": 5 } }));
    assert_eq!(off_schema["result"]["isError"], true, "{off_schema}");
    let text = off_schema["result"]["content"][0]["text"].as_str().unwrap();
    assert!(text.contains("schema") && text.contains("flight_number"), "{text}");

    // Still serving.
    let listed = wire.request(4, "tools/list", json!({}));
    assert!(listed["result"]["tools"].as_array().is_some_and(|t| !t.is_empty()), "{listed}");
}

#[test]
fn a_saga_tool_takes_the_sagas_input_runs_it_with_compensation_and_reports_progress() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let sagas = tempfile::tempdir().unwrap();
    for suffix in ["json", "fixture.json"] {
        let name = format!("ct1-payment-failure.{suffix}");
        std::fs::copy(root.join("sagas").join(&name), sagas.path().join(&name)).unwrap();
    }
    let fixture = root.join("sagas/ct1-payment-failure.fixture.json");
    let mut wire = Wire::start(&["--sagas", sagas.path().to_str().unwrap(), "--state", fixture.to_str().unwrap()]);
    let tools = wire.request(1, "tools/list", json!({}));
    let saga_tool = tools["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "saga_ct1-payment-failure")
        .unwrap_or_else(|| panic!("no saga tool in {tools}"))
        .clone();
    let schema = &saga_tool["inputSchema"];
    assert_eq!(schema["required"], json!(["flight", "hotel", "payment"]), "{schema}");

    let input: Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("sagas/ct1-payment-failure.input.json")).unwrap())
            .unwrap();
    wire.send_line(
        &json!({ "jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
            "name": "saga_ct1-payment-failure", "arguments": input, "_meta": { "progressToken": "p1" } } })
        .to_string(),
    );
    let mut progress = Vec::new();
    let answer = loop {
        let message = wire.next();
        if message["method"] == "notifications/progress" {
            progress.push(message["params"]["message"].as_str().unwrap_or_default().to_string());
        } else if message["id"] == 2 {
            break message;
        }
    };
    let result = &answer["result"];
    assert_eq!(result["isError"], true, "{answer}");
    assert_eq!(result["structuredContent"]["status"], "failed");
    assert_eq!(result["structuredContent"]["failed_step"], "payment");
    assert_eq!(result["structuredContent"]["compensated"], json!(["hotel", "flight"]));
    assert_eq!(
        progress,
        ["completed flight", "completed hotel", "compensated hotel", "compensated flight"],
        "one progress notification per completed step and compensation"
    );
}

#[test]
fn plugin_logs_reach_the_client_at_its_level_before_the_calls_answer() {
    let plugins = tempfile::tempdir().unwrap();
    std::fs::copy(support::artifact("minimal"), plugins.path().join("notes.wasm")).unwrap();
    std::fs::write(plugins.path().join("notes.policy.toml"), "[store]\nwrite = [\"notes\"]\n").unwrap();
    let dir = plugins.path().to_str().unwrap();
    let mut wire = Wire::start(&["--plugins", dir]);
    // No level asked for: no log messages.
    let quiet = wire.request(1, "tools/call", json!({ "name": "notes__add", "arguments": { "text": "a" } }));
    assert_eq!(quiet["result"]["isError"], false, "{quiet}");
    assert!(wire.lines.try_recv().is_err(), "nothing but the answer");

    assert!(wire.request(2, "logging/setLevel", json!({ "level": "info" }))["error"].is_null());
    wire.send_line(
        &json!({ "jsonrpc": "2.0", "id": 3, "method": "tools/call",
                 "params": { "name": "notes__add", "arguments": { "text": "b" } } })
        .to_string(),
    );
    let first = wire.next();
    assert_eq!(first["method"], "notifications/message", "the log comes before the answer: {first}");
    assert_eq!(first["params"]["level"], "info");
    assert_eq!(first["params"]["logger"], "notes.add");
    assert!(first["params"]["data"]["message"].as_str().unwrap().starts_with("stored note-"), "{first}");
    assert_eq!(wire.next()["id"], 3);

    // Above the messages' level: none again.
    assert!(wire.request(4, "logging/setLevel", json!({ "level": "error" }))["error"].is_null());
    wire.send_line(
        &json!({ "jsonrpc": "2.0", "id": 5, "method": "tools/call",
                 "params": { "name": "notes__add", "arguments": { "text": "c" } } })
        .to_string(),
    );
    let answer = wire.next();
    assert_eq!(answer["id"], 5, "no log message at level error: {answer}");
}

/// `sagabox serve --http 127.0.0.1:0 ARGS`, and the address it bound.
fn http_server(args: &[&str]) -> (Server, String) {
    let mut command = serve(&["--http", "127.0.0.1:0"]);
    let child = command.args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn();
    let mut server = Server(child.expect("sagabox serve starts"));
    let mut stderr = BufReader::new(server.0.stderr.take().unwrap());
    let mut line = String::new();
    while stderr.read_line(&mut line).unwrap() > 0 {
        if let Some(rest) = line.trim().strip_prefix("sagabox: serving MCP on http://") {
            let addr = rest.trim_end_matches("/mcp").to_string();
            // Keep draining stderr so the server never blocks on it.
            std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
            return (server, addr);
        }
        line.clear();
    }
    panic!("the server did not say where it serves");
}

/// POSTs a `tools/list` (2025 style) with `headers`; the response's status code.
fn post_status(addr: &str, headers: &[(&str, &str)]) -> u16 {
    use std::io::Read;
    let body = json!({ "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": { "name": "wire", "version": "1" } } })
    .to_string();
    let mut request = format!(
        "POST /mcp HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(&body);
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).unwrap();
    std::str::from_utf8(&head[9..12]).unwrap().parse().unwrap()
}

#[test]
fn http_checks_the_bearer_token_and_the_origin() {
    let (_server, addr) = http_server(&["--token", "s3cret", "--allow-origin", "https://app.example.com:443"]);
    assert_eq!(post_status(&addr, &[]), 401, "no token");
    assert_eq!(post_status(&addr, &[("Authorization", "Bearer wrong")]), 401, "a wrong token");
    assert_eq!(post_status(&addr, &[("Authorization", "Bearer s3cret")]), 200, "the token");
    let with_origin = |origin| post_status(&addr, &[("Authorization", "Bearer s3cret"), ("Origin", origin)]);
    assert_eq!(with_origin("http://localhost:5173"), 200, "a local page");
    assert_eq!(with_origin("https://app.example.com"), 200, "an allowed origin");
    assert_eq!(with_origin("https://evil.example"), 403, "any other origin");
}

#[test]
fn a_public_address_is_refused_without_a_token() {
    let out = support::sagabox(&["serve", "--http", "0.0.0.0:0"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("needs --token"), "{stderr}");
}
