//! `store_pipeline`: stacking stages top to bottom.
//!
//! A spec such as `"Cache|Posix"` names stages from the top (what callers
//! talk to) to the bottom (where blocks persist). Only the bottom stage
//! stores on its own; every stage above it is a tier over the next one
//! ([`Place::Tier`] in the [`registry`]). A name the
//! registry doesn't know is an *external* stage: a store the embedding
//! layer built (one written in Python, registered with its factory); it
//! can only be the bottom.
//!
//! [`open`] builds the whole stack here, in Rust: the bottom first, then
//! each tier over what is below it, so a `Cache|Posix` transfer never
//! crosses into Python.

use std::sync::Arc;

use super::registry::{self, in_words, Clients, Place, StageDef};
use super::Store;
use crate::config::{ConfigError, Geometry, Values};
use crate::error::{Result, UcmError};

/// One stage named in a `store_pipeline`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageName<'a> {
    /// A built-in stage.
    Builtin(&'static str),
    /// Any other name: a store the embedding layer builds.
    External(&'a str),
}

/// Splits `spec` into its stage names (trimmed, as written), top first,
/// and checks their order: every stage but the bottom one is a tier, and
/// the bottom one is not. Errors are about the key `store_pipeline`.
pub fn parse(spec: &str) -> std::result::Result<Vec<StageName<'_>>, ConfigError> {
    let written: Vec<&str> = spec.split('|').map(str::trim).collect();
    let found: Vec<Option<&'static StageDef>> = written.iter().map(|n| registry::find(n)).collect();
    let tiers: Vec<bool> = found
        .iter()
        .map(|s| s.is_some_and(StageDef::is_tier))
        .collect();
    check_order(spec, &written, &tiers)?;
    Ok(written
        .into_iter()
        .zip(found)
        .map(|(name, stage)| match stage {
            Some(s) => StageName::Builtin(s.name()),
            None => StageName::External(name),
        })
        .collect())
}

/// Every stage above the bottom one is a tier, the bottom one is not, and
/// no name is empty.
fn check_order(spec: &str, names: &[&str], tiers: &[bool]) -> std::result::Result<(), ConfigError> {
    let tier_names = registry::names(StageDef::is_tier);
    let quoted: Vec<String> = tier_names.iter().map(|n| format!("'{n}'")).collect();
    let last = names.len() - 1;
    for (i, (name, tier)) in names.iter().zip(tiers).enumerate() {
        if name.is_empty() || (i < last && !tier) {
            return Err(ConfigError::new(
                "store_pipeline",
                format!(
                    "stage {} ('{name}') of '{spec}' sits above another stage, but only {} can",
                    i + 1,
                    in_words(&quoted.iter().map(String::as_str).collect::<Vec<_>>())
                ),
            ));
        }
    }
    if tiers[last] {
        let tier = names[last];
        return Err(ConfigError::new(
            "store_pipeline",
            format!("'{tier}' needs a stage below it, e.g. '{tier}|Posix' or '{tier}|Empty'"),
        ));
    }
    Ok(())
}

/// One stage, ready to open.
pub enum Layer {
    /// A built-in stage with its checked keys.
    Builtin(&'static StageDef, Values),
    /// A store the caller built (the bottom only).
    Given(Arc<dyn Store>),
}

/// Opens the stages `layers` (top first): the bottom one, then each tier
/// over the stage below it. The built-in stages must agree on the block
/// geometry. The pipeline owns a given store: if any stage fails, the
/// stores given and those already opened are closed.
pub fn open(layers: Vec<Layer>, clients: &Clients) -> Result<Arc<dyn Store>> {
    if let Err(e) = check_layers(&layers) {
        for layer in &layers {
            if let Layer::Given(store) = layer {
                let _ = store.close();
            }
        }
        return Err(e);
    }
    let mut layers = layers;
    let bottom = layers.pop().expect("at least one stage");
    let mut store = match bottom {
        Layer::Given(store) => store,
        Layer::Builtin(stage, values) => match stage.place {
            Place::Bottom(open) => open(&values, clients)?,
            Place::Tier(_) => unreachable!("the order was checked"),
        },
    };
    for layer in layers.into_iter().rev() {
        let Layer::Builtin(stage, values) = layer else {
            unreachable!("the order was checked: a given store is the bottom")
        };
        let Place::Tier(open) = stage.place else {
            unreachable!("the order was checked: stages above the bottom are tiers")
        };
        store = match open(&values, store.clone()) {
            Ok(tier) => tier,
            Err(e) => {
                // The tier never took the stages below: close them here.
                let _ = store.close();
                return Err(e);
            }
        };
    }
    Ok(store)
}

/// The order of the stages and their geometry (see [`open`]).
fn check_layers(layers: &[Layer]) -> Result<()> {
    if layers.is_empty() {
        return Err(UcmError::invalid("a pipeline needs at least one stage"));
    }
    let names: Vec<&str> = layers.iter().map(layer_name).collect();
    let tiers: Vec<bool> = layers
        .iter()
        .map(|l| matches!(l, Layer::Builtin(s, _) if s.is_tier()))
        .collect();
    check_order(&names.join("|"), &names, &tiers)?;
    check_geometry(layers)
}

fn layer_name(layer: &Layer) -> &str {
    match layer {
        Layer::Builtin(s, _) => s.name(),
        Layer::Given(store) => store.name(),
    }
}

/// Every built-in stage that knows the block geometry has the same one.
fn check_geometry(layers: &[Layer]) -> Result<()> {
    let mut seen: Option<(&str, (usize, usize))> = None;
    for layer in layers {
        let Layer::Builtin(stage, values) = layer else {
            continue;
        };
        if stage.config.key("block_size").is_none() {
            continue;
        }
        let g = Geometry::from_values(values)?;
        let geo = (g.block_size, g.shard_size);
        match seen {
            None => seen = Some((stage.name(), geo)),
            Some((first, other)) if other != geo => {
                return Err(UcmError::invalid(format!(
                    "stage {}: block_size/shard_size {geo:?} differ from stage {first}'s {other:?}",
                    stage.name()
                )))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Raw;

    #[test]
    fn parse_specs() {
        use StageName::*;
        assert_eq!(
            parse("Cache|Posix").unwrap(),
            vec![Builtin("Cache"), Builtin("Posix")]
        );
        assert_eq!(parse(" Empty ").unwrap(), vec![Builtin("Empty")]);
        assert_eq!(parse("Cache|Ds3fs").unwrap()[1], Builtin("S3"));
        assert_eq!(parse("Cache|MyStore").unwrap()[1], External("MyStore"));
        for bad in [
            "Cache",
            "Posix|Cache",
            "Posix|Empty",
            "Cache||Posix",
            "",
            "Mine|Posix",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        let e = parse("Posix|Empty").unwrap_err();
        assert_eq!(e.key, "store_pipeline");
        assert_eq!(
            e.reason,
            "stage 1 ('Posix') of 'Posix|Empty' sits above another stage, but only 'Cache' can"
        );
        assert!(parse("Cache")
            .unwrap_err()
            .reason
            .contains("needs a stage below"));
    }

    fn layer(name: &str, raw: &[(&str, Raw)]) -> Layer {
        let stage = registry::find(name).unwrap();
        let raw: Vec<(String, Raw)> = raw
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        Layer::Builtin(stage, stage.check(&raw).unwrap())
    }

    #[test]
    fn opens_a_cache_over_a_bottom_and_checks_order_and_geometry() {
        let cache = |block: i128| {
            layer(
                "Cache",
                &[
                    ("block_size", Raw::Int(block)),
                    ("buffer_number", Raw::Int(16)),
                ],
            )
        };
        let store = open(vec![cache(4096), layer("Empty", &[])], &Clients::default()).unwrap();
        assert_eq!(store.name(), "Cache");
        store.close().unwrap();
        assert!(open(vec![layer("Empty", &[]), cache(4096)], &Clients::default()).is_err());
        assert!(open(vec![], &Clients::default()).is_err());
        let dir = tempfile::tempdir().unwrap();
        let posix = layer(
            "Posix",
            &[
                ("block_size", Raw::Int(8192)),
                (
                    "storage_backends",
                    Raw::Str(dir.path().display().to_string()),
                ),
            ],
        );
        let e = open(vec![cache(4096), posix], &Clients::default())
            .err()
            .unwrap();
        assert!(e.to_string().contains("differ from stage Cache's"), "{e}");
    }
}
