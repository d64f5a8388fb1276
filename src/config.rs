//! Configuration: a TOML file, overridden by `COPIER_<KEY>` environment variables, overridden
//! by command-line flags (docs/configuration.md). Every value remembers where it came from, so an error
//! names the key, its source and the rule it broke.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use crate::credentials::CredentialsKey;
pub use crate::secret::Secret;

/// The keys docs/configuration.md lists. Anything else in a file or on the command line is an error.
pub const KEYS: &[&str] = &[
    "database_url",
    "platform",
    "node_id",
    "capacity",
    "lease",
    "fence",
    "cycle",
    "http_listen",
    "log_format",
    "listen_database_url",
    "events_poll",
    "database_pooler",
    "rebalance_margin",
    "rebalance_step",
    "handoff_prepare",
    "reconcile_every",
    "credentials_key",
    "credentials_key_file",
];

/// What sits between a node and PostgreSQL (`database_pooler`): the database layer's own notion.
pub use crate::db::Pooler;

/// Where a configuration value came from; shown in every error about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Default,
    File(String),
    Env(String),
    Flag(String),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => write!(f, "the default"),
            Source::File(path) => write!(f, "config file {path}"),
            Source::Env(var) => write!(f, "environment variable {var}"),
            Source::Flag(flag) => write!(f, "flag {flag}"),
        }
    }
}

/// A configuration problem, always naming the key (or file) and the rule.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("config file {path} is not valid TOML: {reason}")]
    Parse { path: String, reason: String },
    #[error("unknown configuration key `{key}` in {origin} (known keys: {known})")]
    UnknownKey {
        key: String,
        origin: Source,
        known: String,
    },
    #[error("invalid `{key}` from {origin}: {reason}")]
    Invalid {
        key: &'static str,
        origin: Source,
        reason: String,
    },
    #[error("missing `{key}`: set it in the config file, as {env}, or with --{flag}")]
    Missing {
        key: &'static str,
        env: String,
        flag: String,
    },
    #[error("invalid configuration: {rule}")]
    Rule { rule: String },
    /// Several problems, each on its own line, so one attempt shows everything to fix.
    #[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\nerror: "))]
    Many(Vec<ConfigError>),
}

/// Gathers the problems of a configuration so they are reported at once.
#[derive(Debug, Default)]
struct Problems(Vec<ConfigError>);

impl Problems {
    /// The value, or `None` with the problem kept.
    fn take<T>(&mut self, r: Result<T, ConfigError>) -> Option<T> {
        r.map_err(|e| self.0.push(e)).ok()
    }

    fn into_result(mut self) -> Result<(), ConfigError> {
        match self.0.len() {
            0 => Ok(()),
            1 => Err(self.0.remove(0)),
            _ => Err(ConfigError::Many(self.0)),
        }
    }
}

/// Log output format of the `run` command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// The validated configuration of one node.
#[derive(Debug, Clone)]
pub struct Config {
    pub database_url: Secret,
    /// The platform this node serves (`None` only for commands that do not need it).
    pub platform: Option<String>,
    /// `None` until a platform is known: the default is `<platform>-<hostname>`.
    pub node_id: Option<String>,
    pub capacity: u32,
    pub lease: Duration,
    pub fence: Duration,
    pub cycle: Duration,
    pub http_listen: SocketAddr,
    pub log_format: LogFormat,
    pub listen_database_url: Secret,
    /// Learn of master events by polling `master_state` this often instead of LISTEN (`None`:
    /// LISTEN on `listen_database_url`).
    pub events_poll: Option<Duration>,
    /// What sits between the node and PostgreSQL.
    pub database_pooler: Pooler,
    /// Fair share: hand accounts off once above the share by this fraction of it (at least one).
    pub rebalance_margin: f64,
    /// Fair share: hand off at most this fraction of the share per cycle (at least one).
    pub rebalance_step: f64,
    /// Fair-share moves and SIGTERM hand-offs: how long an account handed off keeps copying on
    /// this node while the receiving node logs in ahead (zero: no preparation; not with
    /// `events_poll`).
    pub handoff_prepare: Duration,
    /// How often each follower reconciles regardless of events (repairs a lost last event).
    pub reconcile_every: Duration,
    /// Decrypts broker credentials (`None`: accounts with credentials get an error status).
    pub credentials_key: Option<CredentialsKey>,
}

/// What the `run` command needs on top of [`Config`]: a platform and a node id.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub platform: String,
    pub node_id: String,
    pub capacity: u32,
    pub lease: Duration,
    pub fence: Duration,
    pub cycle: Duration,
    pub rebalance_margin: f64,
    pub rebalance_step: f64,
}

impl Config {
    /// The node's identity and lease timings; fails when `platform` is missing.
    pub fn node(&self) -> Result<NodeConfig, ConfigError> {
        let platform = self.platform.clone().ok_or_else(|| missing("platform"))?;
        let node_id = match &self.node_id {
            Some(id) => id.clone(),
            None => default_node_id(&platform)?,
        };
        Ok(NodeConfig {
            platform,
            node_id,
            capacity: self.capacity,
            lease: self.lease,
            fence: self.fence,
            cycle: self.cycle,
            rebalance_margin: self.rebalance_margin,
            rebalance_step: self.rebalance_step,
        })
    }
}

fn default_node_id(platform: &str) -> Result<String, ConfigError> {
    let host = hostname::get().map_err(|e| ConfigError::Invalid {
        key: "node_id",
        origin: Source::Default,
        reason: format!("cannot read this machine's hostname for the default <platform>-<hostname> ({e}); set node_id"),
    })?;
    Ok(format!("{platform}-{}", host.to_string_lossy()))
}

fn missing(key: &'static str) -> ConfigError {
    ConfigError::Missing {
        key,
        env: if key == "database_url" {
            "COPIER_DATABASE_URL or DATABASE_URL".to_string()
        } else {
            env_name(key)
        },
        flag: key.replace('_', "-"),
    }
}

/// `COPIER_<KEY>` for a key.
pub fn env_name(key: &str) -> String {
    format!("COPIER_{}", key.to_ascii_uppercase())
}

/// The raw layers before parsing: each key's winning value as text and where it came from.
#[derive(Debug, Default)]
pub struct Layers {
    values: BTreeMap<&'static str, (String, Source)>,
    /// `COPIER_*` variables that name no key. Not an error: Kubernetes injects
    /// `<SERVICE>_PORT`-style variables that a Service named `copier-node` would put here.
    pub ignored_env: Vec<String>,
}

impl Layers {
    /// Reads the file (if any), then the environment, then the flags; later layers win.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        flags: &[(&'static str, Option<String>)],
    ) -> Result<Self, ConfigError> {
        let mut layers = Layers::default();
        if let Some(path) = file {
            layers.read_file(path)?;
        }
        layers.read_env(env);
        for (key, value) in flags {
            let key = known_key(key).expect("flags are declared for known keys only");
            if let Some(value) = value {
                layers.set(
                    key,
                    value.clone(),
                    Source::Flag(format!("--{}", key.replace('_', "-"))),
                );
            }
        }
        Ok(layers)
    }

    fn set(&mut self, key: &'static str, value: String, source: Source) {
        self.values.insert(key, (value, source));
    }

    fn read_file(&mut self, path: &Path) -> Result<(), ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: shown.clone(),
            reason: e.to_string(),
        })?;
        let table: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| ConfigError::Parse {
                path: shown.clone(),
                reason: e.to_string(),
            })?;
        for (key, value) in table {
            let source = Source::File(shown.clone());
            let Some(known) = known_key(&key) else {
                return Err(ConfigError::UnknownKey {
                    key,
                    origin: source,
                    known: KEYS.join(", "),
                });
            };
            let text = match value {
                toml::Value::String(s) => s,
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                other => {
                    return Err(ConfigError::Invalid {
                        key: known,
                        origin: source,
                        reason: format!(
                            "expected a string or an integer, got {}",
                            other.type_str()
                        ),
                    });
                }
            };
            self.set(known, text, source);
        }
        Ok(())
    }

    fn read_env(&mut self, env: impl IntoIterator<Item = (String, String)>) {
        for (var, value) in env {
            if var == "DATABASE_URL" {
                // Lower precedence than COPIER_DATABASE_URL: only fills a gap.
                if !matches!(
                    self.values.get("database_url"),
                    Some((_, Source::Env(v))) if v == "COPIER_DATABASE_URL"
                ) {
                    self.set("database_url", value, Source::Env(var));
                }
                continue;
            }
            let Some(rest) = var.strip_prefix("COPIER_") else {
                continue;
            };
            match known_key(&rest.to_ascii_lowercase()) {
                Some(key) => self.set(key, value, Source::Env(var)),
                None => self.ignored_env.push(var),
            }
        }
    }

    fn get(&self, key: &'static str) -> Option<&(String, Source)> {
        self.values.get(key)
    }

    /// Parses and validates every key; every problem is reported at once.
    pub fn resolve(&self) -> Result<Config, ConfigError> {
        self.resolve_for(false)
    }

    /// As [`Self::resolve`] for `run`, which also needs `platform` (reported with the rest).
    pub fn resolve_node(&self) -> Result<Config, ConfigError> {
        self.resolve_for(true)
    }

    fn resolve_for(&self, node: bool) -> Result<Config, ConfigError> {
        let mut p = Problems::default();
        let database_url = p.take(
            self.get("database_url")
                .map(|(v, _)| Secret::new(v.clone()))
                .ok_or_else(|| missing("database_url")),
        );
        let platform = p.take(self.text("platform")).flatten();
        if node && platform.is_none() && self.get("platform").is_none() {
            p.0.push(missing("platform"));
        }
        let node_id = p.take(self.text("node_id")).flatten();
        let capacity = p.take(self.parse("capacity", "100", |v| {
            v.parse::<u32>()
                .map_err(|_| format!("expected a whole number, got {v:?}"))
                .and_then(|n| {
                    if n >= 1 {
                        Ok(n)
                    } else {
                        Err("the rule is capacity >= 1".to_string())
                    }
                })
        }));
        let lease = p.take(self.parse("lease", "60s", parse_duration));
        let fence = p.take(self.parse("fence", "15s", parse_duration));
        let cycle = p.take(self.parse("cycle", "20s", parse_duration));
        let http_listen = p.take(self.parse("http_listen", "0.0.0.0:9464", |v| {
            v.parse::<SocketAddr>()
                .map_err(|_| format!("expected host:port such as 127.0.0.1:9464, got {v:?}"))
        }));
        let log_format = p.take(self.parse("log_format", "text", |v| match v {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err(format!("expected `text` or `json`, got {v:?}")),
        }));
        let fraction = |v: &str| -> Result<f64, String> {
            match v.parse::<f64>() {
                Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
                _ => Err(format!(
                    "expected a fraction of the share between 0 and 1 (e.g. 0.1), got {v:?}"
                )),
            }
        };
        let rebalance_margin = p.take(self.parse("rebalance_margin", "0.1", fraction));
        let rebalance_step = p.take(self.parse("rebalance_step", "0.1", fraction));
        let handoff_prepare = p.take(self.parse("handoff_prepare", "1s", |v| {
            parse_duration(v).and_then(|d| {
                if d <= Duration::from_secs(10) {
                    Ok(d)
                } else {
                    Err("the rule is handoff_prepare <= 10s (0s: hand off without preparing the receiver)".to_string())
                }
            })
        }));
        let events_poll = p.take(self.parse("events_poll", "off", |v| {
            if v == "off" {
                return Ok(None);
            }
            parse_duration(v).and_then(|d| {
                if d >= Duration::from_millis(10) && d <= Duration::from_secs(60) {
                    Ok(Some(d))
                } else {
                    Err("the rule is 10ms <= events_poll <= 60s (or `off`: LISTEN)".to_string())
                }
            })
        }));
        let database_pooler = p.take(self.parse("database_pooler", "none", |v| match v {
            "none" => Ok(Pooler::None),
            "session" => Ok(Pooler::Session),
            "transaction" => Ok(Pooler::Transaction),
            _ => Err(format!(
                "expected `none`, `session` or `transaction`, got {v:?}"
            )),
        }));
        let reconcile_every = p.take(self.parse("reconcile_every", "180s", |v| {
            parse_duration(v).and_then(|d| {
                if d >= Duration::from_secs(1) {
                    Ok(d)
                } else {
                    Err("the rule is reconcile_every >= 1s".to_string())
                }
            })
        }));
        if let (Some(lease), Some(fence), Some(cycle)) = (lease, fence, cycle) {
            p.take(validate_timings(lease, fence, cycle));
        }
        let listen_elsewhere = match (self.get("listen_database_url"), &database_url) {
            (Some((listen, _)), Some(url)) => listen != url.expose(),
            _ => false,
        };
        if database_pooler == Some(Pooler::Transaction)
            && events_poll == Some(None)
            && !listen_elsewhere
        {
            p.take::<()>(Err(ConfigError::Rule {
                rule: "`database_pooler = \"transaction\"` needs `listen_database_url` set to PostgreSQL directly (LISTEN cannot go through a transaction pooler, and PgBouncer before 1.20 refuses the startup options the direct connection carries) or `events_poll` (learn of master events without LISTEN)".into(),
            }));
        }
        let credentials_key = p.take(self.credentials_key());
        p.into_result()?;
        let database_url = database_url.expect("no problems");
        let listen_database_url = self
            .get("listen_database_url")
            .map(|(v, _)| Secret::new(v.clone()))
            .unwrap_or_else(|| database_url.clone());
        Ok(Config {
            database_url,
            platform,
            node_id,
            capacity: capacity.expect("no problems"),
            lease: lease.expect("no problems"),
            fence: fence.expect("no problems"),
            cycle: cycle.expect("no problems"),
            http_listen: http_listen.expect("no problems"),
            log_format: log_format.expect("no problems"),
            listen_database_url,
            events_poll: events_poll.expect("no problems"),
            database_pooler: database_pooler.expect("no problems"),
            rebalance_margin: rebalance_margin.expect("no problems"),
            rebalance_step: rebalance_step.expect("no problems"),
            handoff_prepare: handoff_prepare.expect("no problems"),
            reconcile_every: reconcile_every.expect("no problems"),
            credentials_key: credentials_key.expect("no problems"),
        })
    }

    /// The credentials key, from `COPIER_CREDENTIALS_KEY` (`credentials_key`) or from the secrets
    /// file `credentials_key_file` names; at most one of the two. Errors never show the key.
    pub fn credentials_key(&self) -> Result<Option<CredentialsKey>, ConfigError> {
        match (self.get("credentials_key"), self.get("credentials_key_file")) {
            (Some((_, key_from)), Some((_, file_from))) => Err(ConfigError::Rule {
                rule: format!(
                    "set `credentials_key` (from {key_from}) or `credentials_key_file` (from {file_from}), not both"
                ),
            }),
            (Some((_, origin @ Source::File(_))), None) => Err(ConfigError::Invalid {
                key: "credentials_key",
                origin: origin.clone(),
                reason: "a key does not belong in the config file: set COPIER_CREDENTIALS_KEY in the environment, or point `credentials_key_file` at a secrets file".into(),
            }),
            (Some((value, origin)), None) => CredentialsKey::parse(value)
                .map(Some)
                .map_err(|reason| ConfigError::Invalid {
                    key: "credentials_key",
                    origin: origin.clone(),
                    reason,
                }),
            (None, Some((path, origin))) => {
                let invalid = |reason: String| ConfigError::Invalid {
                    key: "credentials_key_file",
                    origin: origin.clone(),
                    reason,
                };
                let text = std::fs::read_to_string(path.trim())
                    .map_err(|e| invalid(format!("cannot read {}: {e}", path.trim())))?;
                CredentialsKey::parse(&text)
                    .map(Some)
                    .map_err(|reason| invalid(format!("{}: {reason}", path.trim())))
            }
            (None, None) => Ok(None),
        }
    }

    fn text(&self, key: &'static str) -> Result<Option<String>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some((v, source)) if v.trim().is_empty() => Err(ConfigError::Invalid {
                key,
                origin: source.clone(),
                reason: "must not be empty".into(),
            }),
            Some((v, _)) => Ok(Some(v.clone())),
        }
    }

    fn parse<T>(
        &self,
        key: &'static str,
        default: &str,
        parse: impl Fn(&str) -> Result<T, String>,
    ) -> Result<T, ConfigError> {
        let (value, source) = match self.get(key) {
            Some((v, s)) => (v.as_str(), s.clone()),
            None => (default, Source::Default),
        };
        parse(value.trim()).map_err(|reason| ConfigError::Invalid {
            key,
            origin: source,
            reason,
        })
    }
}

fn known_key(key: &str) -> Option<&'static str> {
    KEYS.iter().copied().find(|k| *k == key)
}

/// The timing rules of docs/configuration.md: `0 < fence < lease` and `cycle <= (lease - fence) / 2`,
/// so one failed cycle never closes the gate (jitter only ever shortens a cycle).
pub fn validate_timings(
    lease: Duration,
    fence: Duration,
    cycle: Duration,
) -> Result<(), ConfigError> {
    if fence.is_zero() {
        return Err(ConfigError::Rule {
            rule: "`fence` must be greater than 0 (the rule is 0 < fence < lease)".into(),
        });
    }
    if fence >= lease {
        return Err(ConfigError::Rule {
            rule: format!(
                "`fence` ({}) must be less than `lease` ({}) (the rule is 0 < fence < lease)",
                show(fence),
                show(lease)
            ),
        });
    }
    if cycle.is_zero() {
        return Err(ConfigError::Rule {
            rule: "`cycle` must be greater than 0".into(),
        });
    }
    let window = lease - fence;
    if cycle > window / 2 {
        return Err(ConfigError::Rule {
            rule: format!(
                "`cycle` ({}) must be at most (lease - fence) / 2 = {} (the rule is cycle <= (lease - fence) / 2, so one failed cycle does not close the gate)",
                show(cycle),
                show(window / 2)
            ),
        });
    }
    Ok(())
}

/// Parses `"60s"`, `"1500ms"`, `"2m"`, `"1h"`, or a combination such as `"1m30s"`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("expected a duration such as \"60s\" or \"1500ms\", got {text:?}");
    if text.is_empty() {
        return Err(bad());
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        if digits == 0 {
            return Err(bad());
        }
        let number: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let part = match &rest[..unit_len] {
            "ms" => Duration::from_millis(number),
            "s" => Duration::from_secs(number),
            "m" => Duration::from_secs(number.checked_mul(60).ok_or_else(bad)?),
            "h" => Duration::from_secs(number.checked_mul(3600).ok_or_else(bad)?),
            _ => return Err(bad()),
        };
        total = total.checked_add(part).ok_or_else(bad)?;
        rest = &rest[unit_len..];
    }
    Ok(total)
}

/// A duration as the configuration would write it (`"1500ms"`, `"60s"`).
pub fn show(d: Duration) -> String {
    if d.subsec_millis() == 0 && d.as_secs() > 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(
        file: Option<&str>,
        env: &[(&str, &str)],
        flags: &[(&'static str, &str)],
    ) -> Result<Config, ConfigError> {
        let dir = std::env::temp_dir().join(format!("copier-config-test-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.toml");
        if let Some(text) = file {
            std::fs::write(&path, text).unwrap();
        }
        let flags: Vec<_> = flags
            .iter()
            .map(|(k, v)| (*k, Some(v.to_string())))
            .collect();
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        let result =
            Layers::load(file.map(|_| path.as_path()), env, &flags).and_then(|l| l.resolve());
        std::fs::remove_dir_all(&dir).unwrap();
        result
    }

    #[test]
    fn durations_parse_in_the_spec_forms() {
        for (text, ms) in [
            ("60s", 60_000),
            ("1500ms", 1500),
            ("2m", 120_000),
            ("1h", 3_600_000),
            ("1m30s", 90_000),
            ("0s", 0),
        ] {
            assert_eq!(
                parse_duration(text),
                Ok(Duration::from_millis(ms)),
                "{text}"
            );
        }
        for text in ["", "60", "s", "1.5s", "-1s", "10 s", "5d", "ms10"] {
            assert!(parse_duration(text).is_err(), "{text:?} must be refused");
        }
    }

    #[test]
    fn the_example_config_parses() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/config/copier-node.example.toml"
        ))
        .unwrap();
        let config = resolve(Some(&text), &[], &[]).expect("example config must be valid");
        assert_eq!(config.lease, Duration::from_secs(60));
        assert_eq!(config.fence, Duration::from_secs(15));
        assert_eq!(config.cycle, Duration::from_secs(20));
        assert_eq!(config.capacity, 100);
        assert_eq!(config.platform.as_deref(), Some("mt5"));
    }

    #[test]
    fn flags_override_env_override_file() {
        let file = "database_url = \"postgres://file\"\nplatform = \"mt4\"\ncapacity = 5\nlease = \"30s\"\nfence = \"10s\"\ncycle = \"5s\"\n";
        let config = resolve(
            Some(file),
            &[
                ("COPIER_CAPACITY", "7"),
                ("COPIER_PLATFORM", "mt5"),
                ("DATABASE_URL", "postgres://env"),
            ],
            &[("capacity", "9")],
        )
        .unwrap();
        assert_eq!(config.capacity, 9);
        assert_eq!(config.platform.as_deref(), Some("mt5"));
        assert_eq!(config.database_url.expose(), "postgres://env");
        assert_eq!(config.listen_database_url.expose(), "postgres://env");
        assert_eq!(config.lease, Duration::from_secs(30));
    }

    #[test]
    fn copier_database_url_beats_database_url() {
        let config = resolve(
            None,
            &[
                ("COPIER_DATABASE_URL", "postgres://a"),
                ("DATABASE_URL", "postgres://b"),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(config.database_url.expose(), "postgres://a");
        let config = resolve(
            None,
            &[
                ("DATABASE_URL", "postgres://b"),
                ("COPIER_DATABASE_URL", "postgres://a"),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(config.database_url.expose(), "postgres://a");
    }

    #[test]
    fn unknown_file_keys_are_refused_by_name() {
        let err = resolve(Some("database_url = \"x\"\nleese = \"60s\"\n"), &[], &[]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("`leese`") && msg.contains("config file"),
            "{msg}"
        );
    }

    #[test]
    fn unknown_env_keys_are_ignored_not_fatal() {
        let layers = Layers::load(
            None,
            [(
                "COPIER_NODE_PORT".to_string(),
                "tcp://10.0.0.1:9464".to_string(),
            )],
            &[],
        )
        .unwrap();
        assert_eq!(layers.ignored_env, vec!["COPIER_NODE_PORT".to_string()]);
    }

    #[test]
    fn invalid_values_name_key_and_source() {
        type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);
        let cases: &[Case] = &[
            (&[("COPIER_LEASE", "sixty")], &["`lease`", "COPIER_LEASE"]),
            (
                &[("COPIER_CAPACITY", "0")],
                &["`capacity`", "capacity >= 1"],
            ),
            (
                &[("COPIER_CAPACITY", "-3")],
                &["`capacity`", "whole number"],
            ),
            (&[("COPIER_FENCE", "60s")], &["`fence`", "fence < lease"]),
            (&[("COPIER_FENCE", "0s")], &["`fence`", "0 < fence"]),
            (
                &[("COPIER_CYCLE", "30s")],
                &["`cycle`", "(lease - fence) / 2"],
            ),
            (&[("COPIER_LOG_FORMAT", "xml")], &["`log_format`", "text"]),
            (
                &[("COPIER_HTTP_LISTEN", "nowhere")],
                &["`http_listen`", "host:port"],
            ),
            (&[("COPIER_PLATFORM", " ")], &["`platform`", "empty"]),
            (
                &[("COPIER_REBALANCE_MARGIN", "2")],
                &["`rebalance_margin`", "between 0 and 1"],
            ),
            (
                &[("COPIER_EVENTS_POLL", "1ms")],
                &["`events_poll`", "10ms <= events_poll"],
            ),
            (&[("COPIER_EVENTS_POLL", "often")], &["`events_poll`"]),
            (
                &[("COPIER_DATABASE_POOLER", "transaction")],
                &["database_pooler", "listen_database_url", "events_poll"],
            ),
            (
                &[("COPIER_DATABASE_POOLER", "statement")],
                &["`database_pooler`", "`transaction`"],
            ),
        ];
        for (env, needles) in cases {
            let mut env = env.to_vec();
            env.push(("DATABASE_URL", "postgres://x"));
            let msg = resolve(None, &env, &[]).unwrap_err().to_string();
            for needle in *needles {
                assert!(msg.contains(needle), "{env:?}: {msg:?} lacks {needle:?}");
            }
        }
    }

    #[test]
    fn a_transaction_pooler_takes_a_direct_listen_url_or_polling() {
        for extra in [
            ("COPIER_LISTEN_DATABASE_URL", "postgres://direct/db"),
            ("COPIER_EVENTS_POLL", "100ms"),
        ] {
            let env = [
                ("DATABASE_URL", "postgres://bouncer/db"),
                ("COPIER_DATABASE_POOLER", "transaction"),
                extra,
            ];
            let config = resolve(None, &env, &[]).unwrap_or_else(|e| panic!("{extra:?}: {e}"));
            assert_eq!(config.database_pooler, Pooler::Transaction);
        }
        // LISTEN on the pooler itself is refused.
        let env = [
            ("DATABASE_URL", "postgres://bouncer/db"),
            ("COPIER_LISTEN_DATABASE_URL", "postgres://bouncer/db"),
            ("COPIER_DATABASE_POOLER", "transaction"),
        ];
        let msg = resolve(None, &env, &[]).unwrap_err().to_string();
        assert!(msg.contains("listen_database_url"), "{msg}");
    }

    #[test]
    fn missing_database_url_says_how_to_set_it() {
        let msg = resolve(None, &[], &[]).unwrap_err().to_string();
        assert!(
            msg.contains("database_url")
                && msg.contains("COPIER_DATABASE_URL or DATABASE_URL")
                && msg.contains("--database-url"),
            "{msg}"
        );
    }

    #[test]
    fn every_problem_is_reported_at_once_each_naming_its_key() {
        let layers = Layers::load(
            None,
            [("COPIER_CAPACITY".to_string(), "0".to_string())],
            &[
                ("lease", Some("1x".into())),
                ("log_format", Some("xml".into())),
            ],
        )
        .unwrap();
        let err = layers.resolve_node().unwrap_err();
        let ConfigError::Many(all) = &err else {
            panic!("one error instead of all: {err}");
        };
        let text = err.to_string();
        for key in [
            "`database_url`",
            "`platform`",
            "`capacity`",
            "`lease`",
            "`log_format`",
        ] {
            assert!(text.contains(key), "{key} not reported:\n{text}");
        }
        assert_eq!(all.len(), 5, "{text}");
        assert_eq!(text.lines().count(), 5, "one problem per line:\n{text}");
        // Without `run`'s needs, a platform is not required.
        let err = layers.resolve().unwrap_err().to_string();
        assert!(!err.contains("`platform`"), "{err}");
    }

    #[test]
    fn node_needs_a_platform_and_defaults_its_id() {
        let config = resolve(None, &[("DATABASE_URL", "postgres://x")], &[]).unwrap();
        assert!(config.node().unwrap_err().to_string().contains("platform"));
        let config = resolve(
            None,
            &[("DATABASE_URL", "postgres://x"), ("COPIER_PLATFORM", "mt5")],
            &[],
        )
        .unwrap();
        let host = hostname::get().unwrap().to_string_lossy().to_string();
        assert_eq!(config.node().unwrap().node_id, format!("mt5-{host}"));
    }

    #[test]
    fn secrets_do_not_print() {
        let config = resolve(None, &[("DATABASE_URL", "postgres://u:hunter2@h/db")], &[]).unwrap();
        assert!(!format!("{config:?}").contains("hunter2"));
    }

    #[test]
    fn file_values_of_the_wrong_type_are_refused() {
        let msg = resolve(Some("database_url = \"x\"\ncapacity = true\n"), &[], &[])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("`capacity`") && msg.contains("boolean"),
            "{msg}"
        );
    }

    #[test]
    fn the_credentials_key_comes_from_the_environment_or_a_secrets_file_only() {
        let key = CredentialsKey::generate();
        let db = ("DATABASE_URL", "postgres://x");
        let from_env = resolve(None, &[db, ("COPIER_CREDENTIALS_KEY", &key.encode())], &[]);
        assert_eq!(from_env.unwrap().credentials_key, Some(key.clone()));
        assert_eq!(resolve(None, &[db], &[]).unwrap().credentials_key, None);

        let dir = std::env::temp_dir().join(format!("copier-key-test-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("key");
        std::fs::write(&file, format!("{}\n", key.encode())).unwrap();
        let path = file.display().to_string();
        let from_file = resolve(None, &[db], &[("credentials_key_file", &path)]).unwrap();
        assert_eq!(from_file.credentials_key, Some(key.clone()));

        // Both at once, a key in the config file, a missing file, a file without a key: each
        // refused with the key named and the key's value never shown.
        let both = resolve(
            None,
            &[db, ("COPIER_CREDENTIALS_KEY", &key.encode())],
            &[("credentials_key_file", &path)],
        );
        let in_file = resolve(
            Some(&format!(
                "database_url = \"x\"\ncredentials_key = \"{}\"\n",
                key.encode()
            )),
            &[],
            &[],
        );
        std::fs::write(&file, "not a key").unwrap();
        let bad_file = resolve(None, &[db], &[("credentials_key_file", &path)]);
        let missing = resolve(None, &[db], &[("credentials_key_file", "/nonexistent/key")]);
        let bad_env = resolve(None, &[db, ("COPIER_CREDENTIALS_KEY", "c2hvcnQ=")], &[]);
        std::fs::remove_dir_all(&dir).unwrap();
        for (result, wants) in [
            (both, "not both"),
            (in_file, "does not belong in the config file"),
            (bad_file, "credentials_key_file"),
            (missing, "/nonexistent/key"),
            (bad_env, "decodes to 5 bytes"),
        ] {
            let msg = result.unwrap_err().to_string();
            assert!(msg.contains(wants), "{msg}");
            assert!(msg.contains("credentials_key"), "{msg}");
            assert!(
                !msg.contains(&key.encode()) && !msg.contains("c2hvcnQ="),
                "{msg}"
            );
        }
    }
}
