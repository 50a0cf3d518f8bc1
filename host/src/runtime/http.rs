//! `wasi:http` for plugins: outgoing requests only, each one stopped unless the plugin's
//! network grant lists its host and port.
//!
//! componentize-js links `fetch` into every default build, so a JavaScript plugin imports
//! `wasi:http/types` and `wasi:http/outgoing-handler` whether it makes requests or not. The
//! host provides both (wasmtime-wasi-http, WASI 0.2.x: a guest built against any 0.2 version
//! links) and checks every request against the same allow-list as sockets
//! ([`super::operator::NetAllow`]): a request to a host the grant does not list stops the
//! call with an access-denied error naming the host and what is granted, like a socket
//! connect to it would.

use wasmtime::component::{Linker, Resource};
use wasmtime_wasi_http::p2::bindings::http::{outgoing_handler, types};
use wasmtime_wasi_http::p2::types::{HostFutureIncomingResponse, HostOutgoingRequest};
use wasmtime_wasi_http::{RequestOptions, WasiHttpView};

use super::sandbox::{CallState, WASI_VERSION};

/// Adds `wasi:http/types` and `wasi:http/outgoing-handler`.
pub(crate) fn add_to_linker(linker: &mut Linker<CallState>) -> wasmtime::Result<()> {
    wasmtime_wasi_http::p2::add_only_http_to_linker_async(linker)
}

/// Shadows `outgoing-handler.handle` with one that checks the request's host and port
/// against the plugin's network grant first (the linker must allow shadowing).
pub(crate) fn add_checks(linker: &mut Linker<CallState>) -> wasmtime::Result<()> {
    type Handled = Result<Resource<HostFutureIncomingResponse>, types::ErrorCode>;
    type Args = (Resource<HostOutgoingRequest>, Option<Resource<RequestOptions>>);
    linker.instance(&format!("wasi:http/outgoing-handler@{WASI_VERSION}"))?.func_wrap(
        "handle",
        |mut cx, (request, options): Args| -> wasmtime::Result<(Handled,)> {
            let state = cx.data_mut();
            let endpoint = endpoint(state.http().table.get(&request)?);
            if let Some((host, port)) = endpoint {
                state.check_endpoint(&host, Some(port), "an HTTP request")?;
            }
            // Without a host (or with a scheme it does not speak) nothing is sent: wasmtime's
            // handler answers the guest with its own error code.
            let mut view = state.http();
            match outgoing_handler::Host::handle(&mut view, request, options) {
                Ok(response) => Ok((Ok(response),)),
                Err(e) => Ok((Err(e.downcast()?),)),
            }
        },
    )?;
    Ok(())
}

/// The host and port wasmtime's sender connects to for `request`: the authority's port, else
/// the scheme's (HTTPS when the guest sets none, as the sender defaults). `None` when the
/// request has no parsable authority or a scheme other than HTTP(S): it cannot be sent.
fn endpoint(request: &HostOutgoingRequest) -> Option<(String, u16)> {
    let authority: http::uri::Authority = request.authority.as_deref()?.parse().ok()?;
    let port = match (authority.port_u16(), &request.scheme) {
        (Some(port), _) => port,
        (None, Some(types::Scheme::Http)) => 80,
        (None, Some(types::Scheme::Https) | None) => 443,
        (None, Some(types::Scheme::Other(_))) => return None,
    };
    Some((authority.host().to_string(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(scheme: Option<types::Scheme>, authority: &str) -> HostOutgoingRequest {
        HostOutgoingRequest {
            method: types::Method::Get,
            scheme,
            authority: Some(authority.into()),
            path_with_query: None,
            headers: Default::default(),
            body: None,
        }
    }

    #[test]
    fn a_request_goes_to_its_authority_or_the_scheme_default_port() {
        let to = |scheme, authority| endpoint(&request(scheme, authority));
        assert_eq!(to(Some(types::Scheme::Http), "Example.com"), Some(("Example.com".into(), 80)));
        assert_eq!(to(None, "example.com"), Some(("example.com".into(), 443)));
        assert_eq!(to(Some(types::Scheme::Https), "127.0.0.1:8080"), Some(("127.0.0.1".into(), 8080)));
        assert_eq!(to(Some(types::Scheme::Http), "[::1]:81"), Some(("[::1]".into(), 81)));
        // Userinfo does not hide the host the sender would use.
        assert_eq!(to(Some(types::Scheme::Http), "granted.com@evil.com"), Some(("evil.com".into(), 80)));
        assert_eq!(to(Some(types::Scheme::Other("ftp".into())), "example.com"), None);
        assert_eq!(to(Some(types::Scheme::Http), "bad host"), None);
    }
}
