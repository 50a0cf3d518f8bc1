//! What a plugin may do: its per-call limits and the capabilities it is granted.
//!
//! A plugin's policy is the file `<plugin>.policy.toml` beside `<plugin>.wasm` (the bundled
//! plugins carry theirs in the binary). Without one, a plugin gets the default limits and
//! nothing else: no namespace, no environment, no directory, no network. A policy only
//! *requests*: what a plugin gets is what the operator's ceiling allows of it (see
//! [`super::operator`]).
//!
//! ```toml
//! [store]
//! read = ["flights"]              # namespaces it may read ("*" for all)
//! write = ["reservations"]        # namespaces it may write (and read)
//!
//! [limits]                        # any subset; the rest keep the host defaults
//! fuel = 1_000_000_000
//! deadline_ms = 1000
//! memory_mib = 64
//! stack_kib = 512
//! output_kib = 1024
//!
//! [wasi]
//! env = ["TZ"]                    # host variables the plugin may see
//! network = ["api.example.com:443"] # hosts it may look up and connect to (true: any the operator allows)
//! dirs = [{ host = "data", guest = "/data", writable = false }]
//! ```

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::store::WriteQuota;

/// The upper bounds no policy or override can pass: they size the instance pool.
pub const MAX_MEMORY_MIB: u64 = 1024;
pub const MAX_STACK_KIB: u64 = 8 * 1024;
pub const MAX_INSTANCES: u64 = 64;
pub const MAX_TABLE_ELEMENTS: u64 = 1_000_000;
pub const MAX_DEADLINE_MS: u64 = 24 * 3600 * 1000;

/// Per-call limits, all set.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Fuel units (roughly one per wasm instruction).
    pub fuel: u64,
    /// Wall-clock time for the whole call, host calls included.
    pub deadline_ms: u64,
    /// Linear memory, per memory.
    pub memory_mib: u64,
    /// Wasm stack.
    pub stack_kib: u64,
    /// Elements per table.
    pub table_elements: u64,
    /// Core instances, tables and memories each (a component holds several).
    pub instances: u64,
    /// Size of the JSON result.
    pub output_kib: u64,
    /// Bytes of documents one call may write to the store.
    pub write_kib: u64,
    /// Store writes (puts and deletes) one call may make.
    pub writes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            fuel: 1_000_000_000,
            deadline_ms: 1_000,
            memory_mib: 64,
            stack_kib: 512,
            table_elements: 20_000,
            instances: 32,
            output_kib: 1024,
            write_kib: 4096,
            writes: 1_000,
        }
    }
}

/// Any subset of [`Limits`], laid over another set.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitOverrides {
    pub fuel: Option<u64>,
    pub deadline_ms: Option<u64>,
    pub memory_mib: Option<u64>,
    pub stack_kib: Option<u64>,
    pub table_elements: Option<u64>,
    pub instances: Option<u64>,
    pub output_kib: Option<u64>,
    pub write_kib: Option<u64>,
    pub writes: Option<u64>,
}

impl Limits {
    /// Field by field, the lower of these limits and `cap`, and the name, value and cap of
    /// every field that `cap` lowered.
    pub fn capped(&self, cap: &Limits) -> (Limits, Vec<(&'static str, u64, u64)>) {
        let mut lowered = Vec::new();
        let mut min = |name: &'static str, value: u64, cap: u64| {
            if value > cap {
                lowered.push((name, value, cap));
            }
            value.min(cap)
        };
        let limits = Limits {
            fuel: min("fuel", self.fuel, cap.fuel),
            deadline_ms: min("deadline_ms", self.deadline_ms, cap.deadline_ms),
            memory_mib: min("memory_mib", self.memory_mib, cap.memory_mib),
            stack_kib: min("stack_kib", self.stack_kib, cap.stack_kib),
            table_elements: min("table_elements", self.table_elements, cap.table_elements),
            instances: min("instances", self.instances, cap.instances),
            output_kib: min("output_kib", self.output_kib, cap.output_kib),
            write_kib: min("write_kib", self.write_kib, cap.write_kib),
            writes: min("writes", self.writes, cap.writes),
        };
        (limits, lowered)
    }

    /// These limits with `o`'s fields in place of theirs.
    pub fn with(&self, o: &LimitOverrides) -> Limits {
        Limits {
            fuel: o.fuel.unwrap_or(self.fuel),
            deadline_ms: o.deadline_ms.unwrap_or(self.deadline_ms),
            memory_mib: o.memory_mib.unwrap_or(self.memory_mib),
            stack_kib: o.stack_kib.unwrap_or(self.stack_kib),
            table_elements: o.table_elements.unwrap_or(self.table_elements),
            instances: o.instances.unwrap_or(self.instances),
            output_kib: o.output_kib.unwrap_or(self.output_kib),
            write_kib: o.write_kib.unwrap_or(self.write_kib),
            writes: o.writes.unwrap_or(self.writes),
        }
    }

    /// Refuses limits the host cannot honour.
    pub fn check(&self) -> Result<(), String> {
        let bounded = [
            ("memory_mib", self.memory_mib, MAX_MEMORY_MIB),
            ("stack_kib", self.stack_kib, MAX_STACK_KIB),
            ("instances", self.instances, MAX_INSTANCES),
            ("table_elements", self.table_elements, MAX_TABLE_ELEMENTS),
            ("deadline_ms", self.deadline_ms, MAX_DEADLINE_MS),
        ];
        for (name, value, max) in bounded {
            if value > max {
                return Err(format!("{name} = {value} is above the host's maximum of {max}"));
            }
        }
        if self.stack_kib < 16 {
            return Err(format!("stack_kib = {} is below the minimum of 16", self.stack_kib));
        }
        if self.deadline_ms == 0 || self.memory_mib == 0 || self.instances == 0 {
            return Err("deadline_ms, memory_mib and instances must be positive".into());
        }
        Ok(())
    }

    pub fn deadline(&self) -> Duration {
        Duration::from_millis(self.deadline_ms)
    }

    pub fn memory_bytes(&self) -> usize {
        (self.memory_mib as usize) << 20
    }

    pub fn stack_bytes(&self) -> usize {
        (self.stack_kib as usize) << 10
    }

    pub fn output_bytes(&self) -> usize {
        (self.output_kib as usize) << 10
    }

    pub fn write_quota(&self) -> WriteQuota {
        WriteQuota { bytes: (self.write_kib as usize) << 10, writes: self.writes as usize }
    }
}

/// Namespaces a plugin may touch.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreGrants {
    #[serde(default)]
    pub read: Vec<String>,
    #[serde(default)]
    pub write: Vec<String>,
}

impl StoreGrants {
    fn covers(list: &[String], ns: &str) -> bool {
        list.iter().any(|g| g == "*" || g == ns)
    }

    pub fn can_read(&self, ns: &str) -> bool {
        Self::covers(&self.read, ns) || Self::covers(&self.write, ns)
    }

    pub fn can_write(&self, ns: &str) -> bool {
        Self::covers(&self.write, ns)
    }
}

/// A host directory a plugin may open.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DirGrant {
    /// Host path, relative to the policy file.
    pub host: PathBuf,
    /// Where the plugin sees it.
    pub guest: String,
    #[serde(default)]
    pub writable: bool,
}

/// A host and port a plugin may connect to: `api.example.com:443`, `127.0.0.1:5432`,
/// `[::1]:8080`. Host names are compared case-insensitively, without a trailing dot.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NetTarget {
    /// A lower-case host name, or an IP address (IPv6 without brackets).
    pub host: String,
    pub port: u16,
}

impl NetTarget {
    /// The host as an IP address, when it is one.
    pub fn ip(&self) -> Option<IpAddr> {
        self.host.parse().ok()
    }

    /// `name` as the targets spell their hosts.
    pub fn normalize_host(name: &str) -> String {
        let name = name.strip_prefix('[').and_then(|n| n.strip_suffix(']')).unwrap_or(name);
        name.trim_end_matches('.').to_ascii_lowercase()
    }
}

impl FromStr for NetTarget {
    type Err = String;

    fn from_str(text: &str) -> Result<NetTarget, String> {
        let bad = |why: &str| format!("'{text}' is not a network target ({why}; write \"host:port\")");
        let (host, port) = text.rsplit_once(':').ok_or_else(|| bad("no port"))?;
        let port: u16 = port.parse().ok().filter(|p| *p != 0).ok_or_else(|| bad("the port must be 1 to 65535"))?;
        if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
            return Err(bad("an IPv6 address goes in brackets"));
        }
        let host = NetTarget::normalize_host(host);
        let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | ':');
        if host.is_empty() || !host.chars().all(valid) || host.contains(':') && host.parse::<IpAddr>().is_err() {
            return Err(bad("the host must be a name or an IP address"));
        }
        Ok(NetTarget { host, port })
    }
}

impl fmt::Display for NetTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl Serialize for NetTarget {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for NetTarget {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<NetTarget, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// The network a policy asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Network {
    /// None (`network = false`, the default).
    #[default]
    None,
    /// Whatever the operator allows (`network = true`).
    Any,
    /// These hosts (`network = ["host:port", ...]`): name lookups of the hosts and TCP
    /// connections to their ports.
    Hosts(Vec<NetTarget>),
}

impl Network {
    pub fn is_none(&self) -> bool {
        matches!(self, Network::None) || matches!(self, Network::Hosts(h) if h.is_empty())
    }
}

impl Serialize for Network {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Network::None => s.serialize_bool(false),
            Network::Any => s.serialize_bool(true),
            Network::Hosts(hosts) => hosts.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Network {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Network, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged, expecting = "true, false or a list of \"host:port\" strings")]
        enum Form {
            Flag(bool),
            Hosts(Vec<NetTarget>),
        }
        Ok(match Form::deserialize(d)? {
            Form::Flag(false) => Network::None,
            Form::Flag(true) => Network::Any,
            Form::Hosts(hosts) => Network::Hosts(hosts),
        })
    }
}

/// WASI capabilities beyond the always-present clocks and randomness.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WasiGrants {
    /// Names of host environment variables passed through.
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default)]
    pub dirs: Vec<DirGrant>,
    #[serde(default)]
    pub network: Network,
}

/// A plugin's policy, as written in its policy file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    #[serde(default)]
    pub store: StoreGrants,
    #[serde(default)]
    pub limits: LimitOverrides,
    #[serde(default)]
    pub wasi: WasiGrants,
}

impl Policy {
    /// Parses policy text; `base` resolves relative directory grants.
    pub fn parse(text: &str, base: Option<&Path>) -> Result<Policy, String> {
        let mut policy: Policy = toml::from_str(text).map_err(|e| e.to_string())?;
        if let Some(base) = base {
            for dir in &mut policy.wasi.dirs {
                if dir.host.is_relative() {
                    dir.host = base.join(&dir.host);
                }
            }
        }
        Ok(policy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policy_lays_its_limits_over_the_defaults() {
        let policy =
            Policy::parse("[store]\nread = [\"flights\"]\nwrite = [\"reservations\"]\n[limits]\nfuel = 5\n", None)
                .unwrap();
        let limits = Limits::default().with(&policy.limits);
        assert_eq!(limits.fuel, 5);
        assert_eq!(limits.memory_mib, Limits::default().memory_mib);
        assert!(policy.store.can_read("flights") && !policy.store.can_write("flights"));
        assert!(policy.store.can_read("reservations") && policy.store.can_write("reservations"));
        assert!(!policy.store.can_read("users"));
    }

    #[test]
    fn typos_and_impossible_limits_are_refused() {
        assert!(Policy::parse("[limits]\nfule = 5\n", None).unwrap_err().contains("fule"));
        let huge = Limits::default().with(&LimitOverrides { memory_mib: Some(4096), ..Default::default() });
        assert!(huge.check().unwrap_err().contains("memory_mib"));
    }

    #[test]
    fn relative_dirs_resolve_against_the_policy_file() {
        let policy =
            Policy::parse("[wasi]\ndirs = [{ host = \"data\", guest = \"/data\" }]\n", Some(Path::new("/plugins")))
                .unwrap();
        assert_eq!(policy.wasi.dirs[0].host, Path::new("/plugins/data"));
    }

    #[test]
    fn network_requests_are_flags_or_host_port_lists() {
        let parse = |text: &str| Policy::parse(&format!("[wasi]\nnetwork = {text}\n"), None).map(|p| p.wasi.network);
        assert_eq!(parse("false").unwrap(), Network::None);
        assert_eq!(parse("true").unwrap(), Network::Any);
        let hosts = parse(r#"["API.example.com.:443", "127.0.0.1:5432", "[::1]:8080"]"#).unwrap();
        let Network::Hosts(hosts) = hosts else { panic!("{hosts:?}") };
        let shown: Vec<String> = hosts.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["api.example.com:443", "127.0.0.1:5432", "[::1]:8080"]);
        assert_eq!(hosts[2].ip(), Some("::1".parse().unwrap()));
        for bad in [r#"["example.com"]"#, r#"["example.com:0"]"#, r#"["::1:80"]"#, r#"["a b:80"]"#, "3"] {
            assert!(parse(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn capped_limits_name_what_the_cap_lowered() {
        let asked = Limits { fuel: 5, deadline_ms: 99_000, ..Limits::default() };
        let (capped, lowered) = asked.capped(&Limits::default());
        assert_eq!(capped, Limits { fuel: 5, ..Limits::default() });
        assert_eq!(lowered, [("deadline_ms", 99_000, 1_000)]);
    }
}
