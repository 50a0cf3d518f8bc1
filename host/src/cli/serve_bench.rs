//! `bench --only serve`: MCP round trips and rolled-back agent sessions, measured with a raw
//! JSON-RPC client of our own against `sagabox serve` in a child process. The client's own
//! work (encoding requests, decoding answers) is timed apart.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

use super::bench::Measurement;

/// `sagabox serve ARGS` (this very binary), killed when dropped.
struct ServerProcess(Child);

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn server(args: &[&str], piped: bool) -> anyhow::Result<ServerProcess> {
    let exe = std::env::current_exe().context("cannot find this binary")?;
    let io = || if piped { Stdio::piped() } else { Stdio::null() };
    let child = Command::new(exe)
        .arg("serve")
        .args(args)
        .stdin(io())
        .stdout(io())
        .stderr(if piped { Stdio::null() } else { Stdio::piped() })
        .spawn()
        .context("cannot start sagabox serve")?;
    Ok(ServerProcess(child))
}

/// Round trips of `tools/call hostile__echo {"x":1}` over stdio (2025-11-25 handshake), and
/// the client's share of each.
pub fn stdio_round_trips(fixture: &Path, calls: usize) -> anyhow::Result<Vec<Measurement>> {
    let fixture = fixture.to_string_lossy();
    let mut process = server(&["--state", &fixture], true)?;
    let mut input = process.0.stdin.take().context("no stdin")?;
    let mut output = BufReader::new(process.0.stdout.take().context("no stdout")?);
    let mut line = String::new();
    let mut exchange = |message: &Value, answer: bool| -> anyhow::Result<(Duration, Duration)> {
        let started = Instant::now();
        let mut text = serde_json::to_string(message)?;
        text.push('\n');
        let mut client = started.elapsed();
        input.write_all(text.as_bytes())?;
        input.flush()?;
        if !answer {
            return Ok((started.elapsed(), client));
        }
        line.clear();
        output.read_line(&mut line)?;
        let decoding = Instant::now();
        let value: Value = serde_json::from_str(&line)?;
        if value.get("error").is_some() || value["result"]["isError"] == true {
            bail!("the server answered an error: {value}");
        }
        client += decoding.elapsed();
        Ok((started.elapsed(), client))
    };
    exchange(
        &json!({ "jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": { "name": "bench", "version": "1" } } }),
        true,
    )?;
    exchange(&json!({ "jsonrpc": "2.0", "method": "notifications/initialized" }), false)?;
    let (mut round_trips, mut client) = (Vec::with_capacity(calls), Vec::with_capacity(calls));
    for id in 1..=(calls + calls / 10) as u64 {
        let call = json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call",
                           "params": { "name": "hostile__echo", "arguments": { "x": 1 } } });
        let (total, mine) = exchange(&call, true)?;
        // The first tenth warms up (compilation, caches).
        if id as usize > calls / 10 {
            round_trips.push(total);
            client.push(mine);
        }
    }
    Ok(vec![
        Measurement::from_samples("MCP tools/call round trip over stdio (hostile.echo)", round_trips),
        Measurement::from_samples("  of which the benchmark client's JSON work", client),
    ])
}

/// A keep-alive HTTP/1.1 connection speaking 2026-07-28 (stateless) to `/mcp`.
struct HttpClient {
    stream: BufReader<TcpStream>,
    host: String,
    next_id: u64,
}

impl HttpClient {
    fn connect(addr: &str) -> anyhow::Result<HttpClient> {
        let stream = TcpStream::connect(addr).with_context(|| format!("cannot connect to {addr}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        Ok(HttpClient { stream: BufReader::new(stream), host: addr.to_string(), next_id: 1 })
    }

    /// Calls `tool`; its result (`isError` included).
    fn call(&mut self, tool: &str, arguments: Value) -> anyhow::Result<Value> {
        self.next_id += 1;
        let body = json!({ "jsonrpc": "2.0", "id": self.next_id, "method": "tools/call", "params": {
            "name": tool, "arguments": arguments, "_meta": {
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": {} } } })
        .to_string();
        let request = format!(
            "POST /mcp HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Accept: application/json, text/event-stream\r\nMCP-Protocol-Version: 2026-07-28\r\n\
             Mcp-Method: tools/call\r\nMcp-Name: {tool}\r\nContent-Length: {}\r\n\r\n{body}",
            self.host,
            body.len()
        );
        self.stream.get_mut().write_all(request.as_bytes())?;
        let body = self.response_body()?;
        // A JSON answer, or SSE whose `data:` line holds it.
        let text = String::from_utf8_lossy(&body);
        let json = text.lines().find_map(|l| l.strip_prefix("data:")).unwrap_or(&text).trim();
        let answer: Value = serde_json::from_str(json).with_context(|| format!("not a JSON-RPC answer: {text}"))?;
        match answer.get("result") {
            Some(result) => Ok(result.clone()),
            None => bail!("{tool}: {answer}"),
        }
    }

    fn response_body(&mut self) -> anyhow::Result<Vec<u8>> {
        let mut line = String::new();
        self.stream.read_line(&mut line)?;
        if !line.starts_with("HTTP/1.1 200") {
            bail!("HTTP answer: {}", line.trim());
        }
        let (mut length, mut chunked) = (None, false);
        loop {
            line.clear();
            self.stream.read_line(&mut line)?;
            let header = line.trim();
            if header.is_empty() {
                break;
            }
            let lower = header.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                length = Some(v.trim().parse::<usize>()?);
            }
            chunked |= lower.starts_with("transfer-encoding:") && lower.contains("chunked");
        }
        let mut body = Vec::new();
        if let Some(length) = length {
            body.resize(length, 0);
            self.stream.read_exact(&mut body)?;
        } else if chunked {
            loop {
                line.clear();
                self.stream.read_line(&mut line)?;
                let size = usize::from_str_radix(line.trim(), 16)?;
                let mut chunk = vec![0; size + 2];
                self.stream.read_exact(&mut chunk)?;
                if size == 0 {
                    break;
                }
                body.extend_from_slice(&chunk[..size]);
            }
        } else {
            bail!("an answer with neither length nor chunks");
        }
        Ok(body)
    }
}

/// Agent sessions over one HTTP server, each booking a flight and a hotel and failing at the
/// charge, so that the server compensates both: sessions per second, and their latency.
pub fn http_sessions(
    fixture: &Value,
    input: &Value,
    sessions: usize,
    concurrency: usize,
) -> anyhow::Result<(f64, Measurement)> {
    let dir = std::env::temp_dir().join(format!("sagabox-bench-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("fixture.json");
    std::fs::write(&path, super::bench::roomy(fixture).to_string())?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let addr = format!("127.0.0.1:{port}");
    let process = server(&["--state", &path.to_string_lossy(), "--http", &addr], false)?;
    wait_for(&addr)?;
    let session = |client: &mut HttpClient| -> anyhow::Result<Duration> {
        let started = Instant::now();
        let begun = client.call("saga_begin", json!({}))?;
        let tx = begun["structuredContent"]["transaction"].clone();
        let with_tx = |mut args: Value| {
            args["transaction"] = tx.clone();
            args
        };
        for (tool, args) in [("airline__book", &input["flight"]), ("hotel__reserve", &input["hotel"])] {
            let result = client.call(tool, with_tx(args.clone()))?;
            if result["isError"] == true {
                bail!("{tool} failed: {result}");
            }
        }
        let mut charge = input["payment"].clone();
        charge["reference"] = json!("trip");
        charge["amount"] = json!(100_000);
        let result = client.call("payment__charge", with_tx(charge))?;
        if result["structuredContent"]["status"] != "rolled_back" {
            bail!("the session was not rolled back: {result}");
        }
        Ok(started.elapsed())
    };
    // Warm up: compile, fill caches.
    let mut warm = HttpClient::connect(&addr)?;
    for _ in 0..20 {
        session(&mut warm)?;
    }
    let per_thread = sessions.div_ceil(concurrency);
    let started = Instant::now();
    let latencies: Vec<Duration> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..concurrency)
            .map(|_| {
                scope.spawn(|| -> anyhow::Result<Vec<Duration>> {
                    let mut client = HttpClient::connect(&addr)?;
                    (0..per_thread).map(|_| session(&mut client)).collect()
                })
            })
            .collect();
        let mut all = Vec::new();
        for worker in workers {
            all.extend(worker.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))??);
        }
        Ok::<_, anyhow::Error>(all)
    })?;
    let rate = latencies.len() as f64 / started.elapsed().as_secs_f64();
    drop(process);
    let _ = std::fs::remove_dir_all(&dir);
    let name = format!("rolled-back session over HTTP, {concurrency} clients");
    Ok((rate, Measurement::from_samples(name, latencies)))
}

fn wait_for(addr: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(addr).is_err() {
        if Instant::now() > deadline {
            bail!("sagabox serve did not listen on {addr} within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}
