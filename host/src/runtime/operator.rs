//! The operator's ceiling: what plugins may be granted at most.
//!
//! A plugin's policy file only *requests*; whoever can drop a `.wasm` in a plugin directory
//! can drop its policy too. The runtime grants the request cut down to a ceiling that only
//! the operator sets: namespaces, environment variables, directories and network hosts are
//! intersected with the ceiling's, and every limit is the lower of the two. A request beyond
//! the ceiling is not an error: it is cut, and the cut is recorded (`sagabox plugins` shows it).
//!
//! The ceiling, when the operator gives nothing:
//! - a plugin loaded from a directory: the namespaces it names (never `"*"`), no
//!   environment, no directory, no network, limits at most the runtime's defaults;
//! - a bundled plugin: exactly its shipped policy.
//!
//! The operator's file (`sagabox --operator FILE`, or `SAGABOX_OPERATOR`) raises or lowers
//! these, for every directory plugin (`[default]`) or for one plugin by name
//! (`[plugins.<name>]`, whose unset fields come from `[default]`, or for a bundled plugin
//! from its shipped policy):
//!
//! ```toml
//! [default.store]                   # unset: the namespaces a plugin names, never "*"
//! read = ["flights"]
//! write = []
//!
//! [default.limits]                  # any subset; the rest are the runtime's defaults
//! fuel = 500_000_000
//!
//! [plugins.notes.store]
//! write = ["notes"]
//!
//! [plugins.notes.wasi]
//! env = ["TZ"]                                       # variables it may be passed
//! dirs = [{ host = "/srv/notes", writable = true }]  # roots its directories must lie in
//! network = ["api.example.com:443"]                  # hosts it may look up and connect to
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use wasmtime_wasi::WasiCtxBuilder;
use wasmtime_wasi::sockets::SocketAddrUse;

use super::plugin::valid_name;
use super::policy::{DirGrant, LimitOverrides, Limits, NetTarget, Network, Policy, StoreGrants};

/// Why the operator's configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("cannot read the operator configuration {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: invalid operator configuration: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

/// A host directory under which plugins' directory grants may lie.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DirRoot {
    /// Relative to the operator's file; canonical once loaded.
    pub host: PathBuf,
    /// Whether directories under it may be granted writable.
    #[serde(default)]
    pub writable: bool,
}

/// The WASI part of a section; an unset field is inherited.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WasiCeiling {
    pub env: Option<Vec<String>>,
    pub dirs: Option<Vec<DirRoot>>,
    pub network: Option<Vec<NetTarget>>,
}

/// `[default]` or `[plugins.<name>]` of the operator's file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Section {
    /// Namespaces that may be granted; unset: inherited.
    pub store: Option<StoreGrants>,
    #[serde(default)]
    pub limits: LimitOverrides,
    #[serde(default)]
    pub wasi: WasiCeiling,
}

/// The operator's configuration: the ceiling of every plugin's grants.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Operator {
    /// For plugins loaded from directories.
    #[serde(default)]
    pub default: Section,
    /// By plugin name.
    #[serde(default)]
    pub plugins: BTreeMap<String, Section>,
}

/// What a plugin was granted: its request cut down to the ceiling.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Grant {
    /// The granted namespaces, variables, directories (canonical paths) and hosts; its
    /// `limits` are unused (see `limits`).
    pub policy: Policy,
    pub limits: Limits,
    /// Every part of the request that was cut, and why.
    pub refused: Vec<String>,
}

/// The most one plugin may be granted.
#[derive(Clone, Debug)]
struct Ceiling {
    /// `None`: the namespaces the plugin names, never `"*"`.
    store: Option<StoreGrants>,
    env: Vec<String>,
    dirs: Vec<DirRoot>,
    network: Vec<NetTarget>,
    limits: Limits,
}

impl Operator {
    /// Reads and checks the operator's file; its relative directories are resolved against
    /// the file's directory.
    pub fn load(path: &Path) -> Result<Operator, OperatorError> {
        let text =
            std::fs::read_to_string(path).map_err(|error| OperatorError::Io { path: path.to_path_buf(), error })?;
        let base = path.parent().unwrap_or(Path::new("."));
        Operator::parse(&text, base).map_err(|reason| OperatorError::Invalid { path: path.to_path_buf(), reason })
    }

    /// Parses and checks an operator's file; `base` resolves relative directories.
    pub fn parse(text: &str, base: &Path) -> Result<Operator, String> {
        let mut operator: Operator = toml::from_str(text).map_err(|e| e.to_string())?;
        resolve_roots(&mut operator.default, base)?;
        let base_limits = Limits::default().with(&operator.default.limits);
        base_limits.check().map_err(|e| format!("[default.limits]: {e}"))?;
        for (name, section) in &mut operator.plugins {
            if !valid_name(name) {
                return Err(format!("[plugins.{name}]: '{name}' is not a valid plugin name"));
            }
            resolve_roots(section, base)?;
            base_limits.with(&section.limits).check().map_err(|e| format!("[plugins.{name}.limits]: {e}"))?;
        }
        Ok(operator)
    }

    /// The grant of `plugin`'s `request`: cut down to its ceiling, limits over `defaults`.
    pub fn grant(&self, plugin: &str, bundled: bool, request: &Policy, defaults: &Limits) -> Grant {
        let ceiling = self.ceiling(plugin, bundled, request, defaults);
        let mut refused = Vec::new();
        let mut policy =
            Policy { store: grant_store(&request.store, ceiling.store.as_ref(), &mut refused), ..Policy::default() };
        for name in &request.wasi.env {
            if ceiling.env.contains(name) {
                policy.wasi.env.push(name.clone());
            } else {
                refused.push(format!("wasi.env \"{name}\": not allowed by the operator"));
            }
        }
        policy.wasi.dirs =
            request.wasi.dirs.iter().filter_map(|d| grant_dir(plugin, d, &ceiling.dirs, &mut refused)).collect();
        policy.wasi.network = grant_network(&request.wasi.network, &ceiling.network, &mut refused);
        let (limits, lowered) = defaults.with(&request.limits).capped(&ceiling.limits);
        for (name, asked, cap) in lowered {
            refused.push(format!("limits.{name} = {asked}: above the operator's ceiling of {cap}"));
        }
        if !refused.is_empty() {
            tracing::info!(plugin, refused = %refused.join("; "), "the operator's ceiling cut the plugin's policy");
        }
        Grant { policy, limits, refused }
    }

    fn ceiling(&self, plugin: &str, bundled: bool, request: &Policy, defaults: &Limits) -> Ceiling {
        let base = if bundled {
            Ceiling::shipped(request, defaults)
        } else {
            Ceiling::closed(defaults).layered(&self.default)
        };
        match self.plugins.get(plugin) {
            Some(own) => base.layered(own),
            None => base,
        }
    }
}

impl Ceiling {
    /// Nothing but named namespaces and the default limits.
    fn closed(defaults: &Limits) -> Ceiling {
        Ceiling { store: None, env: Vec::new(), dirs: Vec::new(), network: Vec::new(), limits: defaults.clone() }
    }

    /// A bundled plugin's: its shipped policy, as the binary's author wrote it.
    fn shipped(policy: &Policy, defaults: &Limits) -> Ceiling {
        let dirs = policy
            .wasi
            .dirs
            .iter()
            .filter_map(|d| Some(DirRoot { host: std::fs::canonicalize(&d.host).ok()?, writable: d.writable }))
            .collect();
        let network = match &policy.wasi.network {
            Network::Hosts(hosts) => hosts.clone(),
            Network::None | Network::Any => Vec::new(),
        };
        Ceiling {
            store: Some(policy.store.clone()),
            env: policy.wasi.env.clone(),
            dirs,
            network,
            limits: defaults.with(&policy.limits),
        }
    }

    /// This ceiling with the fields `section` sets in place of its own.
    fn layered(mut self, section: &Section) -> Ceiling {
        if let Some(store) = &section.store {
            self.store = Some(store.clone());
        }
        if let Some(env) = &section.wasi.env {
            self.env = env.clone();
        }
        if let Some(dirs) = &section.wasi.dirs {
            self.dirs = dirs.clone();
        }
        if let Some(network) = &section.wasi.network {
            self.network = network.clone();
        }
        self.limits = self.limits.with(&section.limits);
        self
    }
}

/// Makes a section's directories absolute and canonical; a missing one is an error.
fn resolve_roots(section: &mut Section, base: &Path) -> Result<(), String> {
    for root in section.wasi.dirs.iter_mut().flatten() {
        let joined = base.join(&root.host);
        root.host = std::fs::canonicalize(&joined).map_err(|e| format!("directory {}: {e}", joined.display()))?;
    }
    Ok(())
}

fn push_unique(list: &mut Vec<String>, ns: &str) {
    if !list.iter().any(|n| n == ns) {
        list.push(ns.to_string());
    }
}

/// The requested namespaces that the ceiling covers. A write the ceiling only lets read is
/// granted read-only; `"*"` under a ceiling without it is narrowed to the ceiling's names.
fn grant_store(request: &StoreGrants, ceiling: Option<&StoreGrants>, refused: &mut Vec<String>) -> StoreGrants {
    let mut granted = StoreGrants::default();
    for ns in &request.write {
        match ceiling {
            None if ns == "*" => refused.push("store.write \"*\": every namespace needs the operator's grant".into()),
            None => push_unique(&mut granted.write, ns),
            Some(c) if c.can_write(ns) => push_unique(&mut granted.write, ns),
            Some(c) if ns == "*" => {
                c.write.iter().for_each(|n| push_unique(&mut granted.write, n));
                c.read.iter().for_each(|n| push_unique(&mut granted.read, n));
                refused.push(format!("store.write \"*\": narrowed to what the operator allows ({})", list(c)));
            }
            Some(c) if c.can_read(ns) => {
                push_unique(&mut granted.read, ns);
                refused.push(format!("store.write \"{ns}\": granted read-only (the operator allows no more)"));
            }
            Some(_) => refused.push(format!("store.write \"{ns}\": not allowed by the operator")),
        }
    }
    for ns in &request.read {
        match ceiling {
            None if ns == "*" => refused.push("store.read \"*\": every namespace needs the operator's grant".into()),
            None => push_unique(&mut granted.read, ns),
            Some(c) if c.can_read(ns) => push_unique(&mut granted.read, ns),
            Some(c) if ns == "*" => {
                c.read.iter().chain(&c.write).for_each(|n| push_unique(&mut granted.read, n));
                refused.push(format!("store.read \"*\": narrowed to what the operator allows ({})", list(c)));
            }
            Some(_) => refused.push(format!("store.read \"{ns}\": not allowed by the operator")),
        }
    }
    granted.read.retain(|ns| !granted.write.contains(ns));
    granted
}

/// The namespaces a store ceiling names, for messages.
fn list(store: &StoreGrants) -> String {
    let names: Vec<&str> = store.write.iter().chain(&store.read).map(String::as_str).collect();
    if names.is_empty() { "none".into() } else { names.join(", ") }
}

/// A requested directory, canonical (symlinks and `..` resolved), if it lies under a root.
fn grant_dir(plugin: &str, dir: &DirGrant, roots: &[DirRoot], refused: &mut Vec<String>) -> Option<DirGrant> {
    let asked = dir.host.display();
    let canonical = match std::fs::canonicalize(&dir.host) {
        Ok(path) => path,
        Err(e) => {
            refused.push(format!("wasi.dirs \"{asked}\": plugin '{plugin}' cannot be granted it: {e}"));
            return None;
        }
    };
    let Some(root) = roots.iter().find(|r| canonical.starts_with(&r.host)) else {
        let allowed: Vec<String> = roots.iter().map(|r| r.host.display().to_string()).collect();
        let allowed = if allowed.is_empty() { "none".to_string() } else { allowed.join(", ") };
        refused.push(format!(
            "wasi.dirs \"{asked}\": plugin '{plugin}' may not open {}: it is outside the directories \
             the operator allows ({allowed})",
            canonical.display()
        ));
        return None;
    };
    if dir.writable && !root.writable {
        refused.push(format!("wasi.dirs \"{asked}\": granted read-only ({} is read-only)", root.host.display()));
    }
    Some(DirGrant { host: canonical, guest: dir.guest.clone(), writable: dir.writable && root.writable })
}

/// The requested hosts the ceiling lists (`true`: all it lists).
fn grant_network(request: &Network, allowed: &[NetTarget], refused: &mut Vec<String>) -> Network {
    let shown: Vec<String> = allowed.iter().map(ToString::to_string).collect();
    let shown = if shown.is_empty() { "none".to_string() } else { shown.join(", ") };
    let granted = match request {
        Network::None => Vec::new(),
        Network::Any => {
            if allowed.is_empty() {
                refused.push("wasi.network = true: the operator allows no host".into());
            }
            allowed.to_vec()
        }
        Network::Hosts(hosts) => {
            let (granted, cut): (Vec<_>, Vec<_>) = hosts.iter().cloned().partition(|h| allowed.contains(h));
            for host in cut {
                refused.push(format!("wasi.network \"{host}\": not allowed by the operator (allowed: {shown})"));
            }
            granted
        }
    };
    if granted.is_empty() { Network::None } else { Network::Hosts(granted) }
}

/// The hosts a plugin may reach, as the sandbox enforces them: name lookups of the listed
/// hosts only, and TCP connections only to a listed host's port (a listed name's port on
/// any address the name resolves to). No UDP, no listening.
#[derive(Clone, Debug, Default)]
pub(crate) struct NetAllow {
    targets: Arc<[NetTarget]>,
}

impl NetAllow {
    pub fn new(network: &Network) -> NetAllow {
        match network {
            Network::Hosts(hosts) => NetAllow { targets: hosts.clone().into() },
            Network::None | Network::Any => NetAllow::default(),
        }
    }

    pub fn is_granted(&self) -> bool {
        !self.targets.is_empty()
    }

    /// The granted hosts, for messages.
    pub fn describe(&self) -> String {
        let shown: Vec<String> = self.targets.iter().map(ToString::to_string).collect();
        if shown.is_empty() { "none".into() } else { shown.join(", ") }
    }

    /// Whether a plugin may look `name` up.
    pub fn allows_name(&self, name: &str) -> bool {
        let name = NetTarget::normalize_host(name);
        self.targets.iter().any(|t| t.host == name)
    }

    /// Whether a plugin may reach `name` on `port` through the host (an HTTP request, which
    /// the host sends to the name itself).
    pub fn allows_endpoint(&self, name: &str, port: u16) -> bool {
        let name = NetTarget::normalize_host(name);
        self.targets.iter().any(|t| t.host == name && t.port == port)
    }

    /// Whether a plugin may connect to `addr`.
    pub async fn allows(&self, addr: SocketAddr) -> bool {
        let ip = addr.ip().to_canonical();
        for target in self.targets.iter().filter(|t| t.port == addr.port()) {
            let matched = match target.ip() {
                Some(listed) => listed.to_canonical() == ip,
                None => match tokio::net::lookup_host((target.host.as_str(), target.port)).await {
                    Ok(mut found) => found.any(|a| a.ip().to_canonical() == ip),
                    Err(_) => false,
                },
            };
            if matched {
                return true;
            }
        }
        false
    }

    /// WASI's own check of every socket address: the same rule, so that nothing reaches the
    /// network that the linker's checks let through by mistake.
    pub fn configure(&self, wasi: &mut WasiCtxBuilder) {
        let granted = self.is_granted();
        wasi.allow_tcp(granted).allow_udp(false).allow_ip_name_lookup(granted);
        let allow = self.clone();
        wasi.socket_addr_check(move |addr, use_| {
            let allow = allow.clone();
            Box::pin(async move {
                match use_ {
                    // The implicit bind of a connect: any local address, an ephemeral port.
                    SocketAddrUse::TcpBind => addr.ip().is_unspecified() && addr.port() == 0,
                    SocketAddrUse::TcpConnect => allow.allows(addr).await,
                    _ => false,
                }
            })
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(text: &str, base: &Path) -> Policy {
        Policy::parse(text, Some(base)).unwrap()
    }

    #[test]
    fn without_an_operator_a_directory_plugin_gets_named_namespaces_and_default_limits_only() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("data")).unwrap();
        let asked = request(
            "[store]\nwrite = [\"*\", \"notes\"]\nread = [\"flights\"]\n[limits]\nfuel = 5\ndeadline_ms = 86400000\n\
             [wasi]\nenv = [\"PATH\"]\nnetwork = true\ndirs = [{ host = \"data\", guest = \"/d\" }]\n",
            dir.path(),
        );
        let grant = Operator::default().grant("p", false, &asked, &Limits::default());
        assert_eq!(grant.policy.store, StoreGrants { read: vec!["flights".into()], write: vec!["notes".into()] });
        assert_eq!(grant.policy.wasi, Default::default());
        assert_eq!(grant.limits, Limits { fuel: 5, ..Limits::default() });
        let refused = grant.refused.join("\n");
        for part in ["store.write \"*\"", "wasi.env \"PATH\"", "wasi.network = true", "wasi.dirs", "limits.deadline_ms"]
        {
            assert!(refused.contains(part), "{part} not in:\n{refused}");
        }
    }

    #[test]
    fn a_bundled_plugin_gets_exactly_its_shipped_policy() {
        let shipped = Policy::parse("[store]\nwrite = [\"flights\", \"*\"]\n", None).unwrap();
        let grant = Operator::default().grant("airline", true, &shipped, &Limits::default());
        assert_eq!(grant.policy.store, shipped.store);
        assert!(grant.refused.is_empty(), "{:?}", grant.refused);
        // The operator may still lower it by name.
        let operator = Operator::parse("[plugins.airline.store]\nread = [\"flights\"]\n", Path::new("/")).unwrap();
        let grant = operator.grant("airline", true, &shipped, &Limits::default());
        assert_eq!(grant.policy.store, StoreGrants { read: vec!["flights".into()], write: vec![] });
    }

    #[test]
    fn the_operator_grants_up_to_its_ceiling_and_a_plugin_section_inherits_the_default() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("roots/ro/sub")).unwrap();
        std::fs::create_dir_all(dir.path().join("roots/rw")).unwrap();
        std::fs::create_dir_all(dir.path().join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), dir.path().join("roots/rw/escape")).unwrap();
        let operator = Operator::parse(
            "[default.limits]\nfuel = 7\n[plugins.p.store]\nwrite = [\"a\"]\nread = [\"b\"]\n\
             [plugins.p.wasi]\nenv = [\"TZ\"]\nnetwork = [\"localhost:80\"]\n\
             dirs = [{ host = \"roots/ro\" }, { host = \"roots/rw\", writable = true }]\n",
            dir.path(),
        )
        .unwrap();
        let asked = request(
            "[store]\nwrite = [\"a\", \"b\", \"c\"]\n[limits]\nfuel = 9\n\
             [wasi]\nenv = [\"TZ\", \"HOME\"]\nnetwork = [\"LOCALHOST:80\", \"localhost:81\"]\n\
             dirs = [{ host = \"roots/ro/sub\", guest = \"/ro\", writable = true }, \
             { host = \"roots/rw/../rw\", guest = \"/rw\", writable = true }, \
             { host = \"roots/rw/escape\", guest = \"/x\" }, { host = \"roots/ro/../..\", guest = \"/up\" }]\n",
            dir.path(),
        );
        let grant = operator.grant("p", false, &asked, &Limits::default());
        assert_eq!(grant.policy.store, StoreGrants { read: vec!["b".into()], write: vec!["a".into()] });
        assert_eq!(grant.policy.wasi.env, ["TZ"]);
        assert_eq!(grant.policy.wasi.network, Network::Hosts(vec!["localhost:80".parse().unwrap()]));
        assert_eq!(grant.limits.fuel, 7);
        let roots = std::fs::canonicalize(dir.path().join("roots")).unwrap();
        let dirs: Vec<_> = grant.policy.wasi.dirs.iter().map(|d| (d.host.clone(), d.writable)).collect();
        assert_eq!(dirs, [(roots.join("ro/sub"), false), (roots.join("rw"), true)]);
        let refused = grant.refused.join("\n");
        for part in
            ["store.write \"b\": granted read-only", "store.write \"c\"", "HOME", "localhost:81", "limits.fuel = 9"]
        {
            assert!(refused.contains(part), "{part} not in:\n{refused}");
        }
        for escape in ["roots/rw/escape", "roots/ro/../.."] {
            let line = grant.refused.iter().find(|r| r.contains(escape)).expect(escape);
            assert!(line.contains("plugin 'p'") && line.contains(&roots.join("ro").display().to_string()), "{line}");
        }
        // Another directory plugin gets the default section only.
        let other = operator.grant("q", false, &asked, &Limits::default());
        assert!(other.policy.wasi.dirs.is_empty() && other.policy.wasi.env.is_empty());
        assert_eq!(other.policy.store.write, ["a", "b", "c"]);
    }

    #[test]
    fn bad_operator_files_are_refused() {
        let base = Path::new("/");
        assert!(Operator::parse("[default]\nfule = 1\n", base).unwrap_err().contains("fule"));
        assert!(Operator::parse("[plugins.Bad]\n", base).unwrap_err().contains("Bad"));
        let e = Operator::parse("[plugins.p.wasi]\ndirs = [{ host = \"/no/such/dir\" }]\n", base).unwrap_err();
        assert!(e.contains("/no/such/dir"), "{e}");
        let e = Operator::parse("[default.limits]\nmemory_mib = 99999\n", base).unwrap_err();
        assert!(e.contains("memory_mib"), "{e}");
    }

    #[tokio::test]
    async fn the_network_allow_list_names_hosts_and_ports() {
        let allow =
            NetAllow::new(&Network::Hosts(vec!["127.0.0.1:80".parse().unwrap(), "localhost:81".parse().unwrap()]));
        assert!(allow.allows_name("LOCALHOST.") && allow.allows_name("127.0.0.1") && !allow.allows_name("example.com"));
        assert!(allow.allows("127.0.0.1:80".parse().unwrap()).await);
        assert!(allow.allows("127.0.0.1:81".parse().unwrap()).await, "localhost resolves to 127.0.0.1");
        assert!(!allow.allows("127.0.0.2:80".parse().unwrap()).await);
        assert!(!allow.allows("127.0.0.1:82".parse().unwrap()).await);
        assert!(allow.allows_endpoint("LOCALHOST", 81) && allow.allows_endpoint("[127.0.0.1]", 80));
        assert!(!allow.allows_endpoint("localhost", 80), "a host is granted on its listed port only");
        assert!(!NetAllow::default().is_granted());
    }
}
