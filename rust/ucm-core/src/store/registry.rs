//! Every built-in store stage, declared once.
//!
//! One [`StageDef`] per stage says everything the rest of ucm needs to know
//! about it: its name and one-line doc, the key groups it takes (the keys
//! themselves are declared in `config/keys.toml`), where it sits in a
//! pipeline and how it is opened, the checks across its keys, and how
//! `ucm store` reaches its contents. Everything else reads this table:
//! the pipeline builder ([`super::pipeline`]), the Python bindings
//! (`ucm._native.config_schema`, `NativeStore.open_pipeline`,
//! `Maintenance.open`) and, through them, the Python config checks, the
//! `ucm store` command and the README's key tables.
//!
//! A new backend is a module of its own (its store and config struct), its
//! keys in `keys.toml`, and one entry in [`STAGES`]: no binding, Python or
//! CLI change.

use std::sync::Arc;

use super::maintain::Maintenance;
use super::mooncake::{MooncakeConfig, MooncakeStore, PoolClient};
use super::nfs::{NfsConfig, NfsStore};
use super::posix::{PosixConfig, PosixMaintenance};
use super::s3::{S3Config, S3Maintenance, S3Store};
use super::{CacheConfig, CacheStore, EmptyStore, PosixStore, Store};
use crate::config::keys::{CACHE, COMMON, GEOMETRY, MOONCAKE, NFS, POSIX, S3};
use crate::config::{parse_stage, suggestion, ConfigError, Geometry, Raw, Stage, Values};
use crate::error::{Result, UcmError};

/// One built-in stage.
pub struct StageDef {
    /// Its name, aliases, doc and key groups: what configs are checked by.
    pub config: Stage,
    /// Where it sits in a pipeline, and how it is opened there.
    pub place: Place,
    /// The checks across its keys (capacity against sizes, a location
    /// that parses...), beyond each key's own type and range.
    pub check: fn(&Values) -> std::result::Result<(), ConfigError>,
    /// The client of another system it is opened with, which the embedding
    /// layer builds (see [`Clients`]).
    pub client: Option<ClientKind>,
    /// How `ucm store` reaches its contents, for stages that keep blocks
    /// somewhere it can read: from the stage's keys as given (only those
    /// saying where the blocks live are used).
    pub maintenance: Option<OpenMaintenance>,
}

/// Opens a bottom stage from its checked keys and the clients it needs.
pub type OpenBottom = fn(&Values, &Clients) -> Result<Arc<dyn Store>>;
/// Opens a tier from its checked keys over the stage below it.
pub type OpenTier = fn(&Values, Arc<dyn Store>) -> Result<Arc<dyn Store>>;
/// Opens the maintenance of a stage's contents from its keys as given.
pub type OpenMaintenance = fn(&StageDef, &[(String, Raw)]) -> Result<Arc<dyn Maintenance>>;

/// Where a stage sits in a pipeline.
#[derive(Clone, Copy)]
pub enum Place {
    /// Keeps blocks itself: the bottom of a pipeline.
    Bottom(OpenBottom),
    /// A tier over the stage below it (it needs one).
    Tier(OpenTier),
}

/// A client of another system that a stage calls through a trait, built
/// by the embedding layer (Mooncake's client is a Python library).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientKind {
    /// A Mooncake Store pool ([`PoolClient`]).
    Mooncake,
}

impl ClientKind {
    /// Its name for the bindings.
    pub fn name(self) -> &'static str {
        match self {
            ClientKind::Mooncake => "mooncake",
        }
    }
}

/// The clients the embedding layer built for the stages of one pipeline.
#[derive(Clone, Default)]
pub struct Clients {
    /// The pool of a `Mooncake` stage.
    pub mooncake: Option<Arc<dyn PoolClient>>,
}

/// Every built-in stage, in the order users see them.
pub static STAGES: &[StageDef] = &[
    StageDef {
        config: Stage {
            name: "Posix",
            aliases: &[],
            doc: "One file per block on local or mounted file systems.",
            groups: &[GEOMETRY, POSIX, COMMON],
        },
        place: Place::Bottom(|v, _| {
            let cfg = PosixConfig::from_values(v)?;
            Ok(Arc::new(PosixStore::open(cfg)?))
        }),
        check: |v| PosixConfig::from_values(v).map(drop),
        client: None,
        maintenance: Some(posix_maintenance),
    },
    StageDef {
        config: Stage {
            name: "Cache",
            aliases: &[],
            doc: "A host-memory tier over the stage below it.",
            groups: &[GEOMETRY, CACHE, COMMON],
        },
        place: Place::Tier(|v, below| {
            let cfg = CacheConfig::from_values(v)?;
            Ok(Arc::new(CacheStore::open(cfg, below)?))
        }),
        check: |v| CacheConfig::from_values(v).map(drop),
        client: None,
        maintenance: None,
    },
    StageDef {
        config: Stage {
            name: "S3",
            aliases: &["Ds3fs", "DS3FS"],
            doc: "One object per block in an S3-compatible bucket.",
            groups: &[GEOMETRY, S3, COMMON],
        },
        place: Place::Bottom(|v, _| {
            let cfg = S3Config::from_values(v)?;
            Ok(Arc::new(S3Store::open(cfg)?))
        }),
        check: |v| S3Config::from_values(v).map(drop),
        client: None,
        maintenance: Some(|s3, raw| {
            let cfg = S3Config::from_values(&location_values(s3, raw)?)?;
            Ok(Arc::new(S3Maintenance::open(cfg)?))
        }),
    },
    StageDef {
        config: Stage {
            name: "NFS",
            aliases: &[],
            doc: "One file per block on an NFS export (built-in NFSv3 client, or a kernel mount).",
            groups: &[GEOMETRY, NFS, COMMON],
        },
        place: Place::Bottom(|v, _| {
            let cfg = NfsConfig::from_values(v)?;
            Ok(Arc::new(NfsStore::open(cfg)?))
        }),
        check: |v| NfsConfig::from_values(v).map(drop),
        client: None,
        maintenance: Some(|nfs, raw| {
            let cfg = NfsConfig::from_values(&location_values(nfs, raw)?)?;
            Ok(Arc::from(super::nfs::maintain::maintenance(&cfg)?))
        }),
    },
    StageDef {
        config: Stage {
            name: "Mooncake",
            aliases: &["MooncakeStore"],
            doc: "One object per block in a Mooncake Store pool (cluster-wide DRAM).",
            groups: &[GEOMETRY, MOONCAKE, COMMON],
        },
        place: Place::Bottom(|v, clients| {
            let pool = clients.mooncake.clone().ok_or_else(|| {
                UcmError::invalid(
                    "the Mooncake stage needs its client (ucm.store.mooncake opens it)",
                )
            })?;
            let cfg = MooncakeConfig::from_values(v)?;
            Ok(Arc::new(MooncakeStore::open(cfg, pool)?))
        }),
        check: |v| MooncakeConfig::from_values(v).map(drop),
        client: Some(ClientKind::Mooncake),
        maintenance: None,
    },
    StageDef {
        config: Stage {
            name: "Empty",
            aliases: &[],
            doc: "Keeps nothing: every lookup misses (for tests and baselines).",
            groups: &[COMMON],
        },
        place: Place::Bottom(|v, _| Ok(Arc::new(EmptyStore::new(v.u64("timeout_ms"))))),
        check: |_| Ok(()),
        client: None,
        maintenance: None,
    },
];

impl StageDef {
    /// The name in `store_pipeline`.
    pub fn name(&self) -> &'static str {
        self.config.name
    }

    /// True for a tier (it sits over another stage).
    pub fn is_tier(&self) -> bool {
        matches!(self.place, Place::Tier(_))
    }

    /// Parses the stage's keys as given (`raw`): each key's type and range,
    /// defaults filled in, the block geometry resolved for stages that
    /// store blocks.
    pub fn parse(&self, raw: &[(String, Raw)]) -> std::result::Result<Values, ConfigError> {
        let mut v = parse_stage(&self.config, raw)?;
        if self.config.key("block_size").is_some() {
            Geometry::from_values(&v)?.write_to(&mut v);
        }
        Ok(v)
    }

    /// [`StageDef::parse`], then the checks across keys: exactly what
    /// opening the stage checks before it touches anything.
    pub fn check(&self, raw: &[(String, Raw)]) -> std::result::Result<Values, ConfigError> {
        let v = self.parse(raw)?;
        (self.check)(&v)?;
        Ok(v)
    }

    /// The maintenance of the stage's contents (`ucm store`), from its
    /// keys as given.
    pub fn open_maintenance(&self, raw: &[(String, Raw)]) -> Result<Arc<dyn Maintenance>> {
        match self.maintenance {
            Some(open) => open(self, raw),
            None => Err(UcmError::invalid(format!(
                "store maintenance of {} stages is not available ({} stages only)",
                self.name(),
                in_words(&names(|s| s.maintenance.is_some()))
            ))),
        }
    }
}

/// Every built-in stage.
pub fn stages() -> &'static [StageDef] {
    STAGES
}

/// The built-in stage named `name` (or one of its aliases).
pub fn find(name: &str) -> Option<&'static StageDef> {
    STAGES
        .iter()
        .find(|s| s.config.name == name || s.config.aliases.contains(&name))
}

/// [`find`], or a config error about `store_pipeline` naming the valid
/// stages.
pub fn find_or_err(name: &str) -> std::result::Result<&'static StageDef, ConfigError> {
    find(name).ok_or_else(|| {
        let valid = names(|_| true);
        ConfigError::new(
            "store_pipeline",
            format!(
                "unknown stage {name:?}{}; built-in stages: {}",
                suggestion(name, &valid),
                valid.join(", ")
            ),
        )
    })
}

/// The names of the stages that `keep` says yes to, in table order.
pub fn names(keep: impl Fn(&StageDef) -> bool) -> Vec<&'static str> {
    STAGES
        .iter()
        .filter(|s| keep(s))
        .map(|s| s.config.name)
        .collect()
}

/// `["A", "B", "C"]` as "A, B and C".
pub fn in_words(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [one] => (*one).to_string(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

/// The maintenance of Posix directories: only `storage_backends` is read
/// (one text is one directory, or a list of them); the geometry is
/// read from the blocks themselves.
fn posix_maintenance(_: &StageDef, raw: &[(String, Raw)]) -> Result<Arc<dyn Maintenance>> {
    let given = raw
        .iter()
        .find(|(k, v)| k == "storage_backends" && *v != Raw::Null)
        .map(|(_, v)| v)
        .ok_or_else(|| UcmError::invalid("storage_backends: required"))?;
    let dirs: Vec<std::path::PathBuf> = match given {
        Raw::Str(one) => vec![one.into()],
        Raw::List(items) => items
            .iter()
            .map(|item| match item {
                Raw::Str(p) => Ok(p.into()),
                _ => Err(UcmError::invalid(
                    "storage_backends: expected paths (text), got a list holding something else",
                )),
            })
            .collect::<Result<_>>()?,
        _ => {
            return Err(UcmError::invalid(
                "storage_backends: expected a path, or a list of paths",
            ))
        }
    };
    Ok(Arc::new(PosixMaintenance::new(dirs)?))
}

/// The keys of `stage` in `raw` that say where its blocks live, parsed as
/// a lookup-only store would take them: without a `block_size` the other
/// geometry keys are dropped and a nominal one is used (maintenance reads
/// the geometry from the blocks), and no device is used.
fn location_values(stage: &StageDef, raw: &[(String, Raw)]) -> Result<Values> {
    let given = |key: &str| raw.iter().any(|(k, v)| k == key && *v != Raw::Null);
    let without_geometry = !given("block_size");
    let mut mine: Vec<(String, Raw)> = raw
        .iter()
        .filter(|(k, _)| stage.config.key(k).is_some())
        .filter(|(k, _)| {
            !(without_geometry
                && [
                    "block_size",
                    "shard_size",
                    "tensor_size",
                    "tensor_size_list",
                ]
                .contains(&k.as_str()))
        })
        .filter(|(k, _)| k != "device_id")
        .cloned()
        .collect();
    if without_geometry {
        mine.push(("block_size".into(), Raw::Int(4096)));
    }
    mine.push(("device_id".into(), Raw::Int(-1)));
    Ok(stage.parse(&mine)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Dflt, Kind, MAX_TIMEOUT_MS};

    #[test]
    fn names_and_aliases_are_unique() {
        let mut all: Vec<&str> = STAGES
            .iter()
            .flat_map(|s| std::iter::once(s.config.name).chain(s.config.aliases.iter().copied()))
            .collect();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n);
        assert_eq!(find("Ds3fs").map(StageDef::name), Some("S3"));
        assert!(find_or_err("Posx")
            .err()
            .unwrap()
            .reason
            .contains("`Posix`"));
    }

    #[test]
    fn every_key_is_declared_once_per_stage_with_a_valid_default() {
        for s in stages() {
            let s = &s.config;
            let mut names: Vec<_> = s.keys().map(|k| k.name).collect();
            let n = names.len();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), n, "duplicate key in stage {}", s.name);
            assert!(!s.doc.is_empty(), "{} has no doc", s.name);
            for k in s.keys() {
                assert!(!k.doc.is_empty(), "{}.{} has no doc", s.name, k.name);
                if let Dflt::Is(text) = k.default {
                    let raw = Raw::Str(text.into());
                    assert!(
                        crate::config::convert(k, &raw).is_ok() || k.secret,
                        "{}.{}: default {text:?} does not parse",
                        s.name,
                        k.name
                    );
                }
            }
        }
    }

    #[test]
    fn timeouts_are_capped_at_max_timeout_ms() {
        // keys.toml writes the cap as a number; the code names it.
        for s in stages() {
            for k in s.config.keys().filter(|k| k.name.ends_with("_ms")) {
                assert!(
                    matches!(k.kind, Kind::Int { min: 0, max } if max == MAX_TIMEOUT_MS),
                    "{}.{}: {:?}",
                    s.name(),
                    k.name,
                    k.kind
                );
            }
        }
    }

    #[test]
    fn every_stage_checks_its_defaults_and_opens_where_it_needs_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let dir = dir.path().display().to_string();
        let raw = |s: &StageDef| -> Vec<(String, Raw)> {
            let mut out = Vec::new();
            if s.config.key("block_size").is_some() {
                out.push(("block_size".into(), Raw::Int(4096)));
            }
            if s.config.key("storage_backends").is_some() {
                out.push(("storage_backends".into(), Raw::Str(dir.clone())));
            }
            if s.name() == "Cache" {
                out.push(("buffer_number".into(), Raw::Int(16)));
            }
            out
        };
        for name in ["Posix", "Empty"] {
            let s = find(name).unwrap();
            let v = s.check(&raw(s)).unwrap();
            let Place::Bottom(open) = s.place else {
                panic!("{name} is a bottom stage")
            };
            let store = open(&v, &Clients::default()).unwrap();
            store.close().unwrap();
        }
        let mooncake = find("Mooncake").unwrap();
        let Place::Bottom(open) = mooncake.place else {
            panic!("Mooncake is a bottom stage")
        };
        let posix = find("Posix").unwrap();
        let v = posix.parse(&raw(posix)).unwrap();
        assert!(open(&v, &Clients::default()).is_err(), "no pool given");
    }

    #[test]
    fn maintenance_is_offered_where_declared() {
        let e = find("Empty").unwrap().open_maintenance(&[]).err().unwrap();
        assert!(
            e.to_string().contains("(Posix, S3 and NFS stages only)"),
            "{e}"
        );
        let e = find("Posix").unwrap().open_maintenance(&[]).err().unwrap();
        assert!(e.to_string().contains("storage_backends: required"), "{e}");
    }
}
