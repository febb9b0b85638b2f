//! `store_pipeline`: stacking stores top to bottom.
//!
//! A spec such as `"Cache|Posix"` names stages from the top (what callers
//! talk to) to the bottom (where blocks persist). Only the bottom stage
//! stores on its own; every stage above it is a tier over the next one, so
//! it must be a stage that takes a backend (today: `Cache`). Stages with
//! other names are *external*: stores registered by the embedding layer
//! (the Python factory) that the caller builds and hands in.
//!
//! Composition happens here, in Rust, so the hot path of `Cache|Posix`
//! never crosses into Python; the Python layer validates the flat config
//! (naming the stage and key of any error), builds the bottom stage, and
//! calls [`build`] with it.

use std::sync::Arc;

use super::cache::{CacheConfig, CacheStore};
use super::Store;
use crate::error::{Result, UcmError};

/// One stage of a pipeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StageKind {
    /// The host-memory tier; needs a stage below it.
    Cache,
    /// One file per block.
    Posix,
    /// Keeps nothing.
    Empty,
    /// A store built by the caller (e.g. registered from Python).
    External(String),
}

impl StageKind {
    /// The spelling in `store_pipeline`.
    pub fn name(&self) -> &str {
        match self {
            StageKind::Cache => "Cache",
            StageKind::Posix => "Posix",
            StageKind::Empty => "Empty",
            StageKind::External(n) => n,
        }
    }

    /// True for stages that sit over a backend.
    pub fn is_tier(&self) -> bool {
        matches!(self, StageKind::Cache)
    }
}

/// A parsed `store_pipeline`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineSpec {
    /// Stages, top first.
    pub stages: Vec<StageKind>,
}

impl PipelineSpec {
    /// Parses `"Cache|Posix"`-style specs. Every stage but the last must be
    /// a tier (`Cache`); the last must not be.
    pub fn parse(spec: &str) -> Result<Self> {
        let stages: Vec<StageKind> = spec
            .split('|')
            .map(|s| match s.trim() {
                "Cache" => Ok(StageKind::Cache),
                "Posix" => Ok(StageKind::Posix),
                "Empty" => Ok(StageKind::Empty),
                "" => Err(UcmError::invalid(format!(
                    "store_pipeline {spec:?}: empty stage name"
                ))),
                other => Ok(StageKind::External(other.to_string())),
            })
            .collect::<Result<_>>()?;
        let last = stages.len() - 1;
        for (i, s) in stages.iter().enumerate() {
            if i < last && !s.is_tier() {
                return Err(UcmError::invalid(format!(
                    "store_pipeline {spec:?}: stage {} ({}) is above another stage, but only \
                     Cache can sit over a backend",
                    i + 1,
                    s.name()
                )));
            }
            if i == last && s.is_tier() {
                return Err(UcmError::invalid(format!(
                    "store_pipeline {spec:?}: Cache needs a stage below it (e.g. \"Cache|Posix\" \
                     or \"Cache|Empty\")"
                )));
            }
        }
        Ok(PipelineSpec { stages })
    }

    /// The bottom stage.
    pub fn bottom(&self) -> &StageKind {
        // `parse` never yields an empty list (split gives at least one item).
        &self.stages[self.stages.len() - 1]
    }
}

/// Stacks the tiers of `spec` over an already built `bottom` store, one
/// [`CacheConfig`] per `Cache` stage (top first).
pub fn build(
    spec: &PipelineSpec,
    bottom: Arc<dyn Store>,
    caches: Vec<CacheConfig>,
) -> Result<Arc<dyn Store>> {
    let tiers = spec.stages.len() - 1;
    if caches.len() != tiers {
        return Err(UcmError::invalid(format!(
            "store_pipeline: {tiers} Cache stage(s) but {} cache config(s)",
            caches.len()
        )));
    }
    let mut store = bottom;
    for cfg in caches.into_iter().rev() {
        store = Arc::new(CacheStore::open(cfg, store)?);
    }
    Ok(store)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_specs() {
        let p = PipelineSpec::parse("Cache|Posix").unwrap();
        assert_eq!(p.stages, vec![StageKind::Cache, StageKind::Posix]);
        assert_eq!(
            PipelineSpec::parse(" Empty ").unwrap().stages,
            vec![StageKind::Empty]
        );
        assert_eq!(
            PipelineSpec::parse("Cache|MyStore").unwrap().bottom(),
            &StageKind::External("MyStore".into())
        );
        for bad in ["Cache", "Posix|Cache", "Posix|Empty", "Cache||Posix", ""] {
            assert!(PipelineSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn build_checks_config_count() {
        let spec = PipelineSpec::parse("Cache|Empty").unwrap();
        let bottom: Arc<dyn Store> = Arc::new(crate::store::EmptyStore::new(1000));
        assert!(build(&spec, bottom, vec![]).is_err());
    }
}
