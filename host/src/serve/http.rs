//! Streamable HTTP: the MCP endpoint at `/mcp`, on hyper.
//!
//! A loopback address is served as is (rmcp checks `Host` against DNS rebinding). Any other
//! address needs a token, and every request must carry `Authorization: Bearer <token>`.
//! `Origin`, when a request has one, must be in the allow-list (by default only
//! `http://localhost`, `http://127.0.0.1` and `http://[::1]`, any port).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::TokioIo;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use super::{Connection, ServeError, Server, Transport};

/// The largest request body accepted (a documented cap: 4 MiB).
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// How the HTTP endpoint is exposed.
#[derive(Clone, Debug)]
pub struct HttpOptions {
    pub addr: SocketAddr,
    /// Required unless `addr` is a loopback address.
    pub token: Option<String>,
    /// Browser origins allowed besides the local ones.
    pub allowed_origins: Vec<String>,
    /// How long a legacy (2025) session may stay silent before it ends.
    pub session_timeout: Duration,
}

/// Serves until `stop` is cancelled; `bound` learns the address actually bound (for port 0).
pub async fn serve(
    server: Arc<Server>,
    options: HttpOptions,
    stop: CancellationToken,
    bound: impl FnOnce(SocketAddr),
) -> Result<(), ServeError> {
    let fail = |reason: String| ServeError::Http { addr: options.addr.to_string(), reason };
    if !options.addr.ip().is_loopback() && options.token.is_none() {
        return Err(fail(
            "serving a non-loopback address needs --token (clients then send Authorization: Bearer)".into(),
        ));
    }
    let listener = tokio::net::TcpListener::bind(options.addr).await.map_err(|e| fail(e.to_string()))?;
    let local = listener.local_addr().map_err(|e| fail(e.to_string()))?;
    bound(local);

    let origins: Vec<String> = ["http://localhost:*", "http://127.0.0.1:*", "http://[::1]:*"]
        .into_iter()
        .map(String::from)
        .chain(options.allowed_origins.iter().cloned())
        .collect();
    let mut config = StreamableHttpServerConfig::default()
        .with_allowed_origins(origins)
        .enforce_origin_validation()
        .with_max_request_body_bytes(MAX_BODY_BYTES)
        // A plain JSON answer where no notification comes first: no event stream to hold open.
        .with_json_response(true)
        .with_cancellation_token(stop.child_token());
    if !local.ip().is_loopback() {
        // Clients reach a public address by names rmcp cannot know: the token guards it.
        config = config.disable_allowed_hosts();
    }
    // A legacy session idle this long ends (and its open transaction is compensated).
    let mut sessions = LocalSessionManager::default();
    sessions.session_config.keep_alive = Some(options.session_timeout);
    let mcp = {
        let server = Arc::clone(&server);
        StreamableHttpService::new(
            move || Ok(Connection::new(Arc::clone(&server), Transport::Http)),
            Arc::new(sessions),
            config,
        )
    };
    let token = options.token.as_deref().map(token_digest);
    tracing::info!(addr = %local, "serving MCP over HTTP at /mcp");
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors, say: wait a little rather than spin.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = stop.cancelled() => break,
        };
        let mcp = mcp.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let mcp = mcp.clone();
                async move { Ok::<_, Infallible>(route(&mcp, token.as_ref(), request).await) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            tokio::pin!(connection);
            tokio::select! {
                result = connection.as_mut() => {
                    if let Err(e) = result {
                        tracing::debug!("http connection: {e}");
                    }
                }
                () = stop.cancelled() => connection.as_mut().graceful_shutdown(),
            }
        });
    }
    Ok(())
}

type Body = BoxBody<Bytes, Infallible>;

/// Checks the path and the token, then hands the request to rmcp.
async fn route(
    mcp: &StreamableHttpService<Connection, LocalSessionManager>,
    token: Option<&[u8; 32]>,
    request: Request<Incoming>,
) -> Response<Body> {
    if request.uri().path() != "/mcp" {
        return plain(StatusCode::NOT_FOUND, "the MCP endpoint is /mcp");
    }
    if let Some(expected) = token {
        let given = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(token_digest);
        // Compared as digests: equal length, and no early exit on the secret's bytes.
        if given.as_ref() != Some(expected) {
            let mut response = plain(StatusCode::UNAUTHORIZED, "a valid Authorization: Bearer token is required");
            response.headers_mut().insert(http::header::WWW_AUTHENTICATE, http::HeaderValue::from_static("Bearer"));
            return response;
        }
    }
    let delete = request.method() == http::Method::DELETE;
    let mut response = mcp.handle(request).await;
    if delete && response.status() == StatusCode::ACCEPTED {
        // The session is gone once DELETE returns; MCP clients expect 200 or 204.
        *response.status_mut() = StatusCode::NO_CONTENT;
    }
    response
}

fn plain(status: StatusCode, text: &str) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from(text.to_string())).boxed());
    *response.status_mut() = status;
    response
}

fn token_digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}
