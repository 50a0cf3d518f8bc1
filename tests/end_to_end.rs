//! The end-to-end tests, one module an area, in one test binary (`cargo test --release --test
//! end_to_end -- crash::` runs one area). One binary links wasmtime and the library once, not
//! once an area, and lets a long area's tests share the threads with the others'.

mod support;

mod backend;
mod cli;
mod crash;
mod languages;
mod loading;
mod mcp_wire;
mod model;
mod report_html;
mod runtime;
mod saga;
mod serve;
mod session;
mod taubench;
mod verify;
