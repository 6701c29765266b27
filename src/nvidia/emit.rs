//! The frozen YAML text of device-plugin configs.
//!
//! A device-plugin config key is `<policy>-<hash of this text>`, and a new key relabels every
//! node of the policy and restarts its device plugins. The text must therefore never change for
//! the same config, whatever YAML library the rest of the operator uses: this small emitter
//! writes exactly what the operator has always written (the output of serde_yaml 0.9, proven
//! byte for byte by `tests/yaml_keys.rs` over the examples and random configs).

use std::fmt::Write as _;

use super::{DevicePluginConfig, ReplicatedResources};

/// Whether a plain scalar would be read back as something other than a string (YAML 1.2 core
/// schema as serde_yaml resolves it: null, booleans, integers, floats).
fn resolves_to_non_string(s: &str) -> bool {
    const WORDS: [&str; 13] = [
        "~", "null", "Null", "NULL", "true", "True", "TRUE", "false", "False", "FALSE", ".inf",
        ".Inf", ".INF",
    ];
    if WORDS.contains(&s) || matches!(s, ".nan" | ".NaN" | ".NAN" | "-.inf" | "+.inf") {
        return true;
    }
    let unsigned = s.strip_prefix(['+', '-']).unwrap_or(s);
    let int = |digits: &str, radix: u32| {
        !digits.is_empty() && digits.chars().all(|c| c.is_digit(radix) || c == '_')
    };
    if let Some(h) = unsigned.strip_prefix("0x") {
        return int(h, 16);
    }
    if let Some(o) = unsigned.strip_prefix("0o") {
        return int(o, 8);
    }
    if let Some(b) = unsigned.strip_prefix("0b") {
        return int(b, 2);
    }
    int(unsigned, 10) || (unsigned.chars().any(|c| c.is_ascii_digit()) && s.parse::<f64>().is_ok())
}

/// A string scalar: plain when it is safe and reads back as the same string, else single-quoted.
fn scalar(s: &str) -> String {
    let plain_chars = s
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '/' | '-' | ':'));
    let plain = !s.is_empty()
        && plain_chars
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && !s.ends_with(':')
        && !resolves_to_non_string(s);
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "''"))
    }
}

fn replicated(out: &mut String, key: &str, r: &ReplicatedResources) {
    let _ = writeln!(out, "  {key}:");
    let _ = writeln!(out, "    renameByDefault: {}", r.rename_by_default);
    if let Some(f) = r.fail_requests_greater_than_one {
        let _ = writeln!(out, "    failRequestsGreaterThanOne: {f}");
    }
    if r.resources.is_empty() {
        out.push_str("    resources: []\n");
        return;
    }
    out.push_str("    resources:\n");
    for res in &r.resources {
        let _ = writeln!(out, "    - name: {}", scalar(&res.name));
        if let Some(rename) = &res.rename {
            let _ = writeln!(out, "      rename: {}", scalar(rename));
        }
        match &res.devices {
            Some(d) if d.is_empty() => out.push_str("      devices: []\n"),
            Some(d) => {
                out.push_str("      devices:\n");
                for dev in d {
                    let _ = writeln!(out, "      - {}", scalar(dev));
                }
            }
            None => {}
        }
        let _ = writeln!(out, "      replicas: {}", res.replicas);
    }
}

/// The YAML text of a device-plugin config, as written into the ConfigMap and hashed into its
/// key.
pub fn device_plugin_yaml(c: &DevicePluginConfig) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "version: {}", scalar(&c.version));
    out.push_str("flags:\n");
    let _ = writeln!(out, "  migStrategy: {}", scalar(&c.flags.mig_strategy));
    if let Some(s) = &c.sharing {
        out.push_str("sharing:");
        if s.time_slicing.is_none() && s.mps.is_none() {
            out.push_str(" {}\n");
            return out;
        }
        out.push('\n');
        if let Some(ts) = &s.time_slicing {
            replicated(&mut out, "timeSlicing", ts);
        }
        if let Some(mps) = &s.mps {
            replicated(&mut out, "mps", mps);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_that_would_read_back_as_other_types_are_quoted() {
        for s in [
            "0", "12", "0x1f", "1.5", "1e3", "true", "null", "~", "", "-1",
        ] {
            assert!(scalar(s).starts_with('\''), "{s}");
        }
        for s in [
            "nvidia.com/gpu",
            "0:1",
            "GPU-8b1f",
            "none",
            "v1",
            "mig-1g.10gb",
        ] {
            assert_eq!(scalar(s), s);
        }
    }
}
