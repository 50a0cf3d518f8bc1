//! stdio framing: one JSON-RPC message per line, in front of rmcp.
//!
//! rmcp drops a line that is not JSON, or that is over its length cap, without a word, and
//! the client waits forever for the answer. This front answers both with the JSON-RPC error
//! (`-32700` parse error, `-32600` for a message over [`MAX_LINE_BYTES`]) and passes every
//! other line on. A single writer puts rmcp's lines and these errors on stdout, so that no
//! two messages interleave.

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, DuplexStream};
use tokio::sync::mpsc;

/// The longest message accepted on stdin (4 MiB, like the HTTP body cap).
pub const MAX_LINE_BYTES: usize = 4 << 20;

const PIPE_BYTES: usize = 1 << 16;

/// The ends rmcp serves on; the pumps run until stdin closes and rmcp stops writing.
pub fn framed(
    input: impl AsyncRead + Unpin + Send + 'static,
    output: impl AsyncWrite + Unpin + Send + 'static,
) -> (DuplexStream, DuplexStream) {
    let (rmcp_in, feed) = tokio::io::duplex(PIPE_BYTES);
    let (rmcp_out, from_rmcp) = tokio::io::duplex(PIPE_BYTES);
    let (errors, error_lines) = mpsc::unbounded_channel();
    tokio::spawn(read_messages(input, feed, errors));
    tokio::spawn(write_messages(from_rmcp, error_lines, output));
    (rmcp_in, rmcp_out)
}

/// Passes complete, parseable lines to rmcp; answers the others.
async fn read_messages(input: impl AsyncRead + Unpin, mut feed: DuplexStream, errors: mpsc::UnboundedSender<String>) {
    let mut input = BufReader::new(input);
    let mut line = Vec::new();
    loop {
        line.clear();
        let read = (&mut input).take(MAX_LINE_BYTES as u64 + 1).read_until(b'\n', &mut line).await;
        match read {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if line.len() > MAX_LINE_BYTES && line.last() != Some(&b'\n') {
            let _ = errors.send(error_line(-32600, &format!("Invalid Request: a message over {MAX_LINE_BYTES} bytes")));
            if skip_line(&mut input).await.is_err() {
                break;
            }
            continue;
        }
        let text = line.trim_ascii();
        if text.is_empty() {
            continue;
        }
        if let Err(e) = serde_json::from_slice::<serde_json::Value>(text) {
            let _ = errors.send(error_line(-32700, &format!("Parse error: {e}")));
            continue;
        }
        if line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        if feed.write_all(&line).await.is_err() {
            break;
        }
    }
    // rmcp sees the end of input: the client is gone.
    let _ = feed.shutdown().await;
}

/// Reads and drops the rest of an over-long line.
async fn skip_line(input: &mut BufReader<impl AsyncRead + Unpin>) -> std::io::Result<()> {
    loop {
        let buf = input.fill_buf().await?;
        if buf.is_empty() {
            return Ok(());
        }
        match buf.iter().position(|&b| b == b'\n') {
            Some(at) => {
                input.consume(at + 1);
                return Ok(());
            }
            None => {
                let n = buf.len();
                input.consume(n);
            }
        }
    }
}

/// Writes rmcp's lines and the framing errors, one whole line at a time.
async fn write_messages(
    from_rmcp: DuplexStream,
    mut error_lines: mpsc::UnboundedReceiver<String>,
    mut output: impl AsyncWrite + Unpin,
) {
    let mut lines = BufReader::new(from_rmcp).lines();
    let mut errors_open = true;
    loop {
        let line = tokio::select! {
            line = lines.next_line() => match line {
                Ok(Some(line)) => line,
                _ => break,
            },
            error = error_lines.recv(), if errors_open => match error {
                Some(line) => line,
                None => {
                    errors_open = false;
                    continue;
                }
            },
        };
        let written = async {
            output.write_all(line.as_bytes()).await?;
            output.write_all(b"\n").await?;
            output.flush().await
        };
        if written.await.is_err() {
            break;
        }
    }
}

fn error_line(code: i64, message: &str) -> String {
    serde_json::json!({ "jsonrpc": "2.0", "id": null, "error": { "code": code, "message": message } }).to_string()
}
