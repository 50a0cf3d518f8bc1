//! A loaded plugin: its identity, policy, validated manifest and pre-linked instances.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::Serialize;
use serde_json::Value;

use super::bindings::PluginPre;
use super::bindings::exports::sagabox::plugin::tool::ToolInfo as WitToolInfo;
use super::engine::CompileSource;
use super::error::LoadError;
use super::operator::Grant;
use super::policy::{Limits, Policy};
use super::sandbox::{CallState, Grants};

/// A plugin compiled into the `sagabox` binary.
pub struct BundledPlugin {
    pub name: &'static str,
    pub wasm: &'static [u8],
    pub policy: Option<&'static str>,
}

/// Where a plugin was loaded from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    Bundled,
    File(PathBuf),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Bundled => f.write_str("(bundled)"),
            Origin::File(path) => write!(f, "{}", path.display()),
        }
    }
}

impl Serialize for Origin {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// One tool, as its plugin's manifest declares it.
#[derive(Clone, Debug, Serialize)]
pub struct ToolInfo {
    pub name: String,
    pub description: String,
    pub args_schema: Value,
    pub compensator: Option<String>,
    pub side_effects: bool,
}

/// A tool with its compiled argument schema.
pub struct Tool {
    pub info: ToolInfo,
    validator: jsonschema::Validator,
}

impl fmt::Debug for Tool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.info.fmt(f)
    }
}

impl Tool {
    /// Every way `args` breaks the tool's schema, as `<path>: <message>` lines (at most 5).
    pub fn schema_errors(&self, args: &Value) -> Option<String> {
        // The fast check allocates nothing; errors are collected only for invalid arguments.
        if self.validator.is_valid(args) {
            return None;
        }
        let errors: Vec<String> = self
            .validator
            .iter_errors(args)
            .take(5)
            .map(|e| {
                let at = e.instance_path().to_string();
                if at.is_empty() { e.to_string() } else { format!("{at}: {e}") }
            })
            .collect();
        (!errors.is_empty()).then(|| errors.join("; "))
    }

    /// `args` checked against the schema, as the error a call with them returns.
    pub fn check_args(&self, qualified: &str, args: &Value) -> Result<(), super::CallError> {
        match self.schema_errors(args) {
            None => Ok(()),
            Some(errors) => Err(super::CallError::InvalidInput {
                tool: qualified.to_string(),
                message: format!("arguments do not match the tool's schema: {errors}"),
            }),
        }
    }
}

/// A loaded plugin.
pub struct Plugin {
    pub name: String,
    pub origin: Origin,
    /// Lower-case hex SHA-256 of the component's bytes: the plugin's identity.
    pub sha256: String,
    /// What its policy file (or, bundled, its shipped policy) requests.
    pub policy: Policy,
    /// What it was granted: the request cut down to the operator's ceiling.
    pub grant: Grant,
    /// The granted limits: the host defaults with the policy's limits laid over them, at
    /// most the ceiling's.
    pub limits: Limits,
    pub compiled: CompileSource,
    pub tools: BTreeMap<String, Tool>,
    /// Kept to link it for another stack size; a bundled plugin's are the binary's own.
    pub(crate) wasm: bytes::Bytes,
    pub(crate) grants: Arc<Grants>,
    /// Pre-linked instances, by wasm stack size (one engine per stack size).
    pub(crate) prepared: Mutex<HashMap<u64, PluginPre<CallState>>>,
}

impl fmt::Debug for Plugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plugin").field("name", &self.name).field("sha256", &self.sha256).finish()
    }
}

/// What loading one plugin may cost, whatever its policy says. Loading runs before any
/// call and blocks start-up, so every cost an untrusted file controls is capped; each
/// refusal names the file and the cap (the field's name) an operator can raise.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadCaps {
    /// Largest `.wasm` file, checked before reading it.
    pub max_file_bytes: u64,
    /// Deepest nesting of components and modules (wasmtime's translation costs the square
    /// of it in memory).
    pub max_nesting: usize,
    /// Most functions (core functions plus canonical lifts and lowers) in one plugin.
    pub max_functions: u64,
    /// Most tools one manifest may list.
    pub max_tools: usize,
    /// Longest tool description (bytes).
    pub max_description_bytes: usize,
    /// Longest argument schema (bytes of JSON).
    pub max_schema_bytes: usize,
    /// Fuel of the `manifest` call, at most (a policy may only lower it).
    pub manifest_fuel: u64,
    /// Deadline of the `manifest` call, at most (a policy may only lower it).
    pub manifest_deadline_ms: u64,
    /// Follow symlinks in a plugin directory that lead out of it.
    pub follow_links_out: bool,
}

impl Default for LoadCaps {
    fn default() -> Self {
        LoadCaps {
            max_file_bytes: 64 << 20,
            max_nesting: 100,
            max_functions: 100_000,
            max_tools: 1_000,
            max_description_bytes: 16 << 10,
            max_schema_bytes: 256 << 10,
            manifest_fuel: 1_000_000_000,
            manifest_deadline_ms: 1_000,
            follow_links_out: false,
        }
    }
}

/// A plugin's bytes and policy, before compilation.
pub(crate) struct Source {
    pub name: String,
    pub origin: Origin,
    pub wasm: bytes::Bytes,
    pub policy: Policy,
}

impl Source {
    pub fn bundled(plugin: &BundledPlugin) -> Result<Source, LoadError> {
        let policy = match plugin.policy {
            Some(text) => Policy::parse(text, None).map_err(|reason| LoadError::InvalidPolicy {
                path: PathBuf::from(format!("(bundled {})", plugin.name)),
                reason,
            })?,
            None => Policy::default(),
        };
        Ok(Source {
            name: plugin.name.to_string(),
            origin: Origin::Bundled,
            wasm: bytes::Bytes::from_static(plugin.wasm),
            policy,
        })
    }

    /// Reads `<dir>/<name>.wasm` and its policy `<dir>/<name>.policy.toml`, if any.
    pub fn file(path: &Path, caps: &LoadCaps) -> Result<Source, LoadError> {
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string();
        if !valid_name(&name) {
            return Err(LoadError::InvalidName { path: path.to_path_buf(), name });
        }
        let wasm = read_capped(path, caps.max_file_bytes, "max_file_bytes")?;
        let policy_path = path.with_file_name(format!("{name}.policy.toml"));
        let policy = match std::fs::symlink_metadata(&policy_path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Policy::default(),
            // Read like the `.wasm`: capped, regular files only, never blocking on a FIFO.
            _ => {
                let bytes = read_capped(&policy_path, MAX_POLICY_BYTES, "policy size (64 KiB)")?;
                let text = String::from_utf8(bytes).map_err(|e| LoadError::InvalidPolicy {
                    path: policy_path.clone(),
                    reason: format!("not UTF-8: {e}"),
                })?;
                Policy::parse(&text, policy_path.parent())
                    .map_err(|reason| LoadError::InvalidPolicy { path: policy_path.clone(), reason })?
            }
        };
        Ok(Source { name, origin: Origin::File(path.to_path_buf()), wasm: wasm.into(), policy })
    }

    pub fn path(&self) -> PathBuf {
        match &self.origin {
            Origin::Bundled => PathBuf::from(format!("(bundled {})", self.name)),
            Origin::File(path) => path.clone(),
        }
    }

    /// Refuses bytes that are not a component before wasmtime sees them, with a reason a
    /// plugin author can act on.
    pub fn check_header(&self) -> Result<(), LoadError> {
        let path = self.path();
        let bytes = &self.wasm;
        if bytes.len() < 8 || &bytes[..4] != b"\0asm" {
            return Err(LoadError::NotWasm { path });
        }
        match bytes[4..8] {
            [1, 0, 0, 0] => Err(LoadError::CoreModule { path }),
            [0x0d, 0, 1, 0] => Ok(()),
            _ => Err(LoadError::InvalidComponent {
                path,
                reason: format!("unknown binary version/layer {:02x?}", &bytes[4..8]),
            }),
        }
    }
}

/// Refuses a structure whose translation would cost more than `caps` allow: nesting deeper
/// than `max_nesting` (wasmtime's memory grows with its square), more than `max_functions`
/// functions. One linear pass with wasmparser, before wasmtime sees the bytes.
pub(crate) fn check_structure(wasm: &[u8], path: &Path, caps: &LoadCaps) -> Result<(), LoadError> {
    let over = |cap, detail| LoadError::OverCap { path: path.to_path_buf(), cap, detail };
    let (mut depth, mut functions) = (0usize, 0u64);
    for payload in wasmparser::Parser::new(0).parse_all(wasm) {
        use wasmparser::Payload;
        let payload =
            payload.map_err(|e| LoadError::InvalidComponent { path: path.to_path_buf(), reason: e.to_string() })?;
        match payload {
            Payload::Version { .. } => depth += 1,
            Payload::End(_) => depth = depth.saturating_sub(1),
            Payload::FunctionSection(s) => functions += u64::from(s.count()),
            Payload::ComponentCanonicalSection(s) => functions += u64::from(s.count()),
            _ => {}
        }
        if depth > caps.max_nesting {
            return Err(over("max_nesting", format!("components nested more than {} deep", caps.max_nesting)));
        }
        if functions > caps.max_functions {
            return Err(over("max_functions", format!("more than {} functions", caps.max_functions)));
        }
    }
    Ok(())
}

/// The bytes of the regular file at `path`, refused over `limit` before reading; never
/// blocks on a FIFO (it is refused as not a regular file).
/// A policy file is a few lines of TOML.
const MAX_POLICY_BYTES: u64 = 64 << 10;

fn read_capped(path: &Path, limit: u64, cap: &'static str) -> Result<Vec<u8>, LoadError> {
    use std::io::Read;
    let io = |error| LoadError::Io { path: path.to_path_buf(), error };
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NONBLOCK);
    let file = options.open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(LoadError::NotAPlugin { path: path.to_path_buf(), reason: "not a regular file".into() });
    }
    if meta.len() > limit {
        let detail = format!("the file is {} bytes, more than {limit}", meta.len());
        return Err(LoadError::OverCap { path: path.to_path_buf(), cap, detail });
    }
    let mut wasm = Vec::with_capacity(meta.len() as usize);
    // `take`: the file may grow between the check and the read.
    file.take(limit + 1).read_to_end(&mut wasm).map_err(io)?;
    if wasm.len() as u64 > limit {
        let detail = format!("the file grew past {limit} bytes while being read");
        return Err(LoadError::OverCap { path: path.to_path_buf(), cap, detail });
    }
    Ok(wasm)
}

/// Refuses a manifest over `caps` before anything in it is parsed or compiled.
fn check_manifest_size(infos: &[WitToolInfo], caps: &LoadCaps) -> Result<(), (&'static str, String)> {
    if infos.len() > caps.max_tools {
        return Err(("max_tools", format!("the manifest lists {} tools, more than {}", infos.len(), caps.max_tools)));
    }
    for info in infos {
        let name = info.name.get(..info.name.len().min(64)).unwrap_or("?");
        if info.description.len() > caps.max_description_bytes {
            let detail = format!(
                "tool '{name}': its description is {} bytes, more than {}",
                info.description.len(),
                caps.max_description_bytes
            );
            return Err(("max_description_bytes", detail));
        }
        if info.args_schema.len() > caps.max_schema_bytes {
            let detail = format!(
                "tool '{name}': its args-schema is {} bytes, more than {}",
                info.args_schema.len(),
                caps.max_schema_bytes
            );
            return Err(("max_schema_bytes", detail));
        }
    }
    Ok(())
}

/// Plugin and tool names: lower-case letters, digits, `_` and `-`, starting with a letter
/// or digit (so that `<plugin>.<tool>` is unambiguous).
pub fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

/// A manifest over a [`LoadCaps`] cap, or one that breaks a rule.
#[derive(Debug)]
pub(crate) enum ManifestError {
    OverCap(&'static str, String),
    Invalid(String),
}

impl From<String> for ManifestError {
    fn from(reason: String) -> ManifestError {
        ManifestError::Invalid(reason)
    }
}

impl ManifestError {
    pub fn at(self, path: PathBuf) -> LoadError {
        match self {
            ManifestError::OverCap(cap, detail) => LoadError::OverCap { path, cap, detail },
            ManifestError::Invalid(reason) => LoadError::InvalidManifest { path, reason },
        }
    }
}

/// Checks a manifest: within `caps`, then valid unique names, valid JSON Schemas, existing
/// compensators.
pub(crate) fn validate_manifest(
    infos: Vec<WitToolInfo>,
    caps: &LoadCaps,
) -> Result<BTreeMap<String, Tool>, ManifestError> {
    check_manifest_size(&infos, caps).map_err(|(cap, detail)| ManifestError::OverCap(cap, detail))?;
    Ok(validate_tools(infos)?)
}

/// The rules of a manifest within its caps.
fn validate_tools(infos: Vec<WitToolInfo>) -> Result<BTreeMap<String, Tool>, String> {
    if infos.is_empty() {
        return Err("the manifest lists no tools".into());
    }
    let mut tools = BTreeMap::new();
    for info in &infos {
        if !valid_name(&info.name) {
            return Err(format!(
                "'{}' is not a valid tool name (use lower-case letters, digits, '_' and '-')",
                info.name
            ));
        }
        if tools.contains_key(&info.name) {
            return Err(format!("the tool '{}' is listed twice", info.name));
        }
        let schema: Value = serde_json::from_str(&info.args_schema)
            .map_err(|e| format!("tool '{}': args-schema is not JSON: {e}", info.name))?;
        let validator = jsonschema::validator_for(&schema)
            .map_err(|e| format!("tool '{}': args-schema is not a valid JSON Schema: {e}", info.name))?;
        let tool = ToolInfo {
            name: info.name.clone(),
            description: info.description.clone(),
            args_schema: schema,
            compensator: info.compensator.clone(),
            side_effects: info.side_effects,
        };
        tools.insert(info.name.clone(), Tool { info: tool, validator });
    }
    for tool in tools.values() {
        if let Some(compensator) = &tool.info.compensator {
            if compensator == &tool.info.name {
                return Err(format!("tool '{}' names itself as its compensator", tool.info.name));
            }
            if !tools.contains_key(compensator) {
                return Err(format!(
                    "tool '{}' names the compensator '{compensator}', which the plugin does not have",
                    tool.info.name
                ));
            }
        }
    }
    Ok(tools)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, schema: &str, compensator: Option<&str>) -> WitToolInfo {
        WitToolInfo {
            name: name.into(),
            description: String::new(),
            args_schema: schema.into(),
            compensator: compensator.map(Into::into),
            side_effects: compensator.is_some(),
        }
    }

    #[test]
    fn names() {
        assert!(valid_name("airline") && valid_name("read_file") && valid_name("a-1"));
        assert!(!valid_name("") && !valid_name("Air") && !valid_name("a.b") && !valid_name("_x"));
    }

    #[test]
    fn manifests_are_checked() {
        let ok = r#"{"type":"object"}"#;
        assert!(validate_tools(vec![info("book", ok, Some("cancel")), info("cancel", ok, None)]).is_ok());
        let e = validate_tools(vec![info("book", ok, Some("unbook"))]).unwrap_err();
        assert!(e.contains("unbook"), "{e}");
        let e = validate_tools(vec![info("a", ok, None), info("a", ok, None)]).unwrap_err();
        assert!(e.contains("twice"), "{e}");
        let e = validate_tools(vec![info("a", r#"{"type":"no-such-type"}"#, None)]).unwrap_err();
        assert!(e.contains("not a valid JSON Schema"), "{e}");
        let e = validate_tools(vec![info("a", "{", None)]).unwrap_err();
        assert!(e.contains("not JSON"), "{e}");
        assert!(validate_tools(vec![]).is_err());
    }
}
