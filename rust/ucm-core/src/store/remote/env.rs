//! `${VAR}` / `${VAR:-default}` expansion in config values.

use crate::error::{Result, UcmError};

/// Expands `${VAR}` and `${VAR:-default}` in a config value from the
/// environment. An unset variable without a default is an error naming the
/// config key and the variable, never the value of anything.
pub fn expand_env(key: &str, value: &str) -> Result<String> {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| UcmError::invalid(format!("{key}: unterminated '${{' in the value")))?;
        let expr = &after[..end];
        let (name, default) = match expr.split_once(":-") {
            Some((n, d)) => (n, Some(d)),
            None => (expr, None),
        };
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(UcmError::invalid(format!(
                "{key}: invalid environment variable name {name:?} in '${{...}}'"
            )));
        }
        match std::env::var(name) {
            Ok(v) if !v.is_empty() => out.push_str(&v),
            _ => match default {
                Some(d) => out.push_str(d),
                None => {
                    return Err(UcmError::invalid(format!(
                        "{key}: environment variable {name} is not set"
                    )))
                }
            },
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn env_expansion() {
        std::env::set_var("UCM_TEST_EXPAND_A", "alpha");
        std::env::remove_var("UCM_TEST_EXPAND_MISSING");
        assert_eq!(
            expand_env("k", "x${UCM_TEST_EXPAND_A}y").unwrap(),
            "xalphay"
        );
        assert_eq!(expand_env("k", "plain").unwrap(), "plain");
        assert_eq!(
            expand_env("k", "${UCM_TEST_EXPAND_MISSING:-dflt}").unwrap(),
            "dflt"
        );
        let e = expand_env("s3_access_key", "${UCM_TEST_EXPAND_MISSING}").unwrap_err();
        assert!(
            e.to_string().contains("s3_access_key")
                && e.to_string().contains("UCM_TEST_EXPAND_MISSING"),
            "{e}"
        );
        assert!(expand_env("k", "${UNTERMINATED").is_err());
        assert!(expand_env("k", "${bad name}").is_err());
    }
}
