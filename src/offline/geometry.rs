//! `gpu-sharing-operator mig-geometry`: the MIG geometry the operator checks layouts against,
//! without a cluster. Lists the GPU models it knows, shows one model's profiles and placements,
//! places one GPU's instances (as the operator does before it labels a node), and, for tests
//! that compare it with NVIDIA's own data, answers a batch of such questions line by line.

use std::fmt::Write as _;

use crate::nvidia::geometry::{self, MODELS, Model};

/// The model of a GPU as GFD labels it, or an error naming what was given.
pub fn model(product: &str, memory_mib: Option<u64>) -> Result<&'static Model, String> {
    geometry::model_for(product, memory_mib).ok_or_else(|| {
        let memory = memory_mib.map_or(String::new(), |m| format!(" with {m} MiB"));
        format!(
            "no MIG geometry is known for {product}{memory} (models known: {})",
            MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
        )
    })
}

/// Every model: name, compute and memory slices, where its numbers come from.
pub fn models() -> String {
    let mut s = String::new();
    for m in MODELS {
        let _ = writeln!(
            s,
            "{}\t{} GiB\t{} compute slices\t{} memory slices\t{}",
            m.name, m.total_gib, m.compute_slices, m.memory_slices, m.source
        );
    }
    s
}

/// One model's GPU-instance profiles with their slices and allowed placements.
pub fn profiles(m: &Model) -> String {
    let mut s = format!(
        "{}: {} compute slices, {} memory slices\n",
        m.name, m.compute_slices, m.memory_slices
    );
    for p in m.profiles {
        let starts: Vec<String> = p.starts.iter().map(u8::to_string).collect();
        let _ = writeln!(
            s,
            "  {:<16} compute {}  memory {}  starts {{{}}}  at most {} per GPU",
            p.name,
            p.compute,
            p.memory,
            starts.join(","),
            p.max_instances
        );
    }
    s
}

/// Places one GPU's instances: the placement as text, or why not (with the nearest feasible
/// layout where one exists).
pub fn place(m: &'static Model, instances: &[&str]) -> Result<String, String> {
    geometry::place(m, instances)
        .map(|placed| geometry::render(m, &placed))
        .map_err(|e| e.to_string())
}

/// Answers a batch: each input line is `PRODUCT<TAB>MEMORY_MIB<TAB>PROFILES` (memory may be
/// empty; profiles comma-separated, one per instance), each output line repeats the three
/// fields and adds the verdict (`feasible`, `infeasible` or `unknown-model`) and its detail
/// (the placement, the reason). Blank lines and lines starting with `#` are skipped.
pub fn batch(input: &str) -> Result<String, String> {
    let mut out = String::new();
    for (i, line) in input.lines().enumerate() {
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split('\t').collect();
        let [product, memory, profiles] = fields[..] else {
            return Err(format!(
                "line {}: expected PRODUCT<TAB>MEMORY_MIB<TAB>PROFILES, got {line:?}",
                i + 1
            ));
        };
        let memory_mib = match memory.trim() {
            "" => None,
            m => Some(
                m.parse::<u64>()
                    .map_err(|e| format!("line {}: memory {m:?}: {e}", i + 1))?,
            ),
        };
        let instances: Vec<&str> = profiles.split(',').filter(|p| !p.is_empty()).collect();
        let (verdict, detail) = match model(product, memory_mib) {
            Err(e) => ("unknown-model", e),
            Ok(m) => match place(m, &instances) {
                Ok(p) => ("feasible", p),
                Err(e) => ("infeasible", e),
            },
        };
        let _ = writeln!(out, "{product}\t{memory}\t{profiles}\t{verdict}\t{detail}");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_answers_each_line_with_a_verdict() {
        let out = batch(
            "# product\tmemory\tprofiles\n\
             NVIDIA-A100-SXM4-80GB\t81920\t3g.40gb,2g.20gb,1g.10gb,1g.10gb\n\
             NVIDIA-A100-SXM4-80GB\t81920\t3g.40gb,3g.40gb,2g.20gb\n\
             NVIDIA-T4\t\t1g.5gb\n",
        )
        .unwrap();
        let verdicts: Vec<&str> = out.lines().map(|l| l.split('\t').nth(3).unwrap()).collect();
        assert_eq!(verdicts, ["feasible", "infeasible", "unknown-model"]);
        assert!(out.contains("[3g.40gb@"), "{out}");
        assert!(
            out.contains("no MIG geometry is known for NVIDIA-T4"),
            "{out}"
        );
        let err = batch("NVIDIA-A100-SXM4-80GB\t3g.40gb\n").unwrap_err();
        assert!(err.starts_with("line 1: expected"), "{err}");
    }

    #[test]
    fn profiles_show_each_placement() {
        let m = model("NVIDIA-A30", None).unwrap();
        let text = profiles(m);
        assert!(text.starts_with("A30-24GB: 4 compute slices"), "{text}");
        assert!(text.contains("2g.12gb"), "{text}");
        assert!(models().lines().count() == MODELS.len());
    }
}
