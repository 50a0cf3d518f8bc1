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
}

/// A loaded plugin.
pub struct Plugin {
    pub name: String,
    pub origin: Origin,
    /// Lower-case hex SHA-256 of the component's bytes: the plugin's identity.
    pub sha256: String,
    pub policy: Policy,
    /// The host defaults with the policy's limits laid over them.
    pub limits: Limits,
    pub compiled: CompileSource,
    pub tools: BTreeMap<String, Tool>,
    pub(crate) wasm: Arc<[u8]>,
    pub(crate) grants: Arc<Grants>,
    /// Pre-linked instances, by wasm stack size (one engine per stack size).
    pub(crate) prepared: Mutex<HashMap<u64, PluginPre<CallState>>>,
}

impl fmt::Debug for Plugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plugin").field("name", &self.name).field("sha256", &self.sha256).finish()
    }
}

/// A plugin's bytes and policy, before compilation.
pub(crate) struct Source {
    pub name: String,
    pub origin: Origin,
    pub wasm: Arc<[u8]>,
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
        Ok(Source { name: plugin.name.to_string(), origin: Origin::Bundled, wasm: plugin.wasm.into(), policy })
    }

    /// Reads `<dir>/<name>.wasm` and its policy `<dir>/<name>.policy.toml`, if any.
    pub fn file(path: &Path) -> Result<Source, LoadError> {
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string();
        if !valid_name(&name) {
            return Err(LoadError::InvalidName { path: path.to_path_buf(), name });
        }
        let wasm = std::fs::read(path).map_err(|error| LoadError::Io { path: path.to_path_buf(), error })?;
        let policy_path = path.with_file_name(format!("{name}.policy.toml"));
        let policy = match std::fs::read_to_string(&policy_path) {
            Ok(text) => Policy::parse(&text, policy_path.parent())
                .map_err(|reason| LoadError::InvalidPolicy { path: policy_path.clone(), reason })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Policy::default(),
            Err(error) => return Err(LoadError::Io { path: policy_path, error }),
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

/// Plugin and tool names: lower-case letters, digits, `_` and `-`, starting with a letter
/// or digit (so that `<plugin>.<tool>` is unambiguous).
pub fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

/// Checks a manifest: valid unique names, valid JSON Schemas, existing compensators.
pub(crate) fn validate_manifest(infos: Vec<WitToolInfo>) -> Result<BTreeMap<String, Tool>, String> {
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
        assert!(validate_manifest(vec![info("book", ok, Some("cancel")), info("cancel", ok, None)]).is_ok());
        let e = validate_manifest(vec![info("book", ok, Some("unbook"))]).unwrap_err();
        assert!(e.contains("unbook"), "{e}");
        let e = validate_manifest(vec![info("a", ok, None), info("a", ok, None)]).unwrap_err();
        assert!(e.contains("twice"), "{e}");
        let e = validate_manifest(vec![info("a", r#"{"type":"no-such-type"}"#, None)]).unwrap_err();
        assert!(e.contains("not a valid JSON Schema"), "{e}");
        let e = validate_manifest(vec![info("a", "{", None)]).unwrap_err();
        assert!(e.contains("not JSON"), "{e}");
        assert!(validate_manifest(vec![]).is_err());
    }
}
