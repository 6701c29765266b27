//! MIG profiles as NVIDIA names them (`[Nc.]Ng.NNgb[+me|+me.all|+gfx|-me]`), and the limits of
//! NVIDIA's sharing mechanisms.

/// Compute slices of a full GPU (A100, H100, H200, B200); the limit for one GPU's MIG devices.
pub const MAX_COMPUTE_SLICES: i32 = 7;
/// MPS replicas NVIDIA allows (16 below compute capability 7.5).
pub const MPS_MAX_REPLICAS: i32 = 48;
pub const MPS_MAX_REPLICAS_OLD_GPUS: i32 = 16;

/// Whether `p` is a MIG profile name: `[Nc.]Ng.NNgb[+me|+me.all|+gfx|-me]`.
pub fn is_mig_profile(p: &str) -> bool {
    parse_mig_profile(p).is_some()
}

/// A parsed MIG profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigProfile {
    /// Compute instance slices (`Nc.`), when given.
    pub compute: Option<u32>,
    /// GPU instance slices (`Ng`).
    pub slices: u32,
    /// Memory in GB.
    pub memory_gb: u32,
}

fn digits(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0'))
    {
        return None;
    }
    s.parse().ok()
}

/// Parses `[Nc.]Ng.NNgb[+me|+me.all|+gfx|-me]`.
pub fn parse_mig_profile(p: &str) -> Option<MigProfile> {
    let base = ["+me.all", "+me", "+gfx", "-me"]
        .iter()
        .find_map(|s| p.strip_suffix(s))
        .unwrap_or(p);
    let mut parts: Vec<&str> = base.split('.').collect();
    let compute = if parts.len() == 3 {
        let c = parts.remove(0);
        Some(digits(c.strip_suffix('c')?)?)
    } else {
        None
    };
    if parts.len() != 2 {
        return None;
    }
    let slices = digits(parts[0].strip_suffix('g')?)?;
    let memory_gb = digits(parts[1].strip_suffix("gb")?)?;
    if slices == 0
        || slices > 8
        || memory_gb == 0
        || compute == Some(0)
        || compute.is_some_and(|c| c > slices)
    {
        return None;
    }
    Some(MigProfile {
        compute,
        slices,
        memory_gb,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_grammar() {
        for ok in [
            "1g.10gb",
            "1c.2g.20gb",
            "7g.141gb",
            "1g.10gb+me",
            "1g.24gb+me.all",
            "1g.24gb+gfx",
            "1g.24gb-me",
        ] {
            assert!(is_mig_profile(ok), "{ok}");
        }
        for bad in [
            "",
            "1g",
            "1g.10",
            "0g.10gb",
            "1g.10gb+foo",
            "g.10gb",
            "1G.10GB",
            "3c.2g.20gb",
            "01g.10gb",
        ] {
            assert!(!is_mig_profile(bad), "{bad}");
        }
        assert_eq!(
            parse_mig_profile("3g.71gb"),
            Some(MigProfile {
                compute: None,
                slices: 3,
                memory_gb: 71
            })
        );
    }
}
