//! `plan`'s human output: tables like `kubectl get`, one section per kind of change.

use std::fmt::Write;

use super::report::{Change, NodeSharing, PolicyChange, PolicySide, Preview};
use crate::api::crd::Capacity;

/// Left-aligned columns, two spaces apart.
fn table(out: &mut String, rows: &[Vec<String>]) {
    let widths: Vec<usize> = (0..rows.first().map_or(0, Vec::len))
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        let _ = writeln!(out, "  {}", line.join("  ").trim_end());
    }
}

fn arrow(before: &str, after: &str) -> String {
    if before == after {
        before.to_string()
    } else {
        format!("{before} -> {after}")
    }
}

fn or_dash(s: Option<&str>) -> String {
    s.filter(|s| !s.is_empty()).unwrap_or("-").to_string()
}

fn capacity(c: Option<&Capacity>) -> (String, String) {
    match c {
        None => ("-".into(), "-".into()),
        Some(c) => (
            c.schedulable_replicas.to_string(),
            c.memory_per_client_mib
                .map_or("-".into(), |m| m.to_string()),
        ),
    }
}

fn policy_row(
    name: &str,
    change: PolicyChange,
    b: Option<&PolicySide>,
    a: Option<&PolicySide>,
) -> Vec<String> {
    let field =
        |f: fn(&PolicySide) -> String| arrow(&b.map_or("-".into(), f), &a.map_or("-".into(), f));
    let change = serde_json::to_value(change)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default();
    vec![
        name.to_string(),
        change,
        field(|s| s.strategy.clone()),
        field(|s| or_dash(Some(&s.nodes))),
        field(|s| capacity(s.capacity.as_ref()).0),
        field(|s| capacity(s.capacity.as_ref()).1),
        or_dash(a.map(|s| s.ready.as_str())),
    ]
}

fn sharing(s: &NodeSharing) -> [String; 4] {
    let policy = match (&s.policy, &s.strategy) {
        (Some(p), Some(st)) => format!("{p} ({st})"),
        (Some(p), None) => p.clone(),
        _ => "-".into(),
    };
    [
        policy,
        or_dash(s.config.as_deref()),
        or_dash(s.mig_layout.as_deref()),
        match (&s.workload, &s.vgpu_config) {
            (Some(w), Some(v)) => format!("{w} {v}"),
            (Some(w), None) => w.clone(),
            _ => "-".into(),
        },
    ]
}

fn keys(out: &mut String, title: &str, added: &[String], removed: &[String]) {
    if added.is_empty() && removed.is_empty() {
        return;
    }
    let _ = writeln!(out, "\n{title}:");
    for k in added {
        let _ = writeln!(out, "  + {k}");
    }
    for k in removed {
        let _ = writeln!(out, "  - {k}");
    }
}

fn value(v: &Option<serde_json::Value>) -> String {
    match v {
        None => "(unset)".into(),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    }
}

fn cluster_policy(out: &mut String, changes: &[Change<serde_json::Value>]) {
    if changes.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nClusterPolicy:");
    for c in changes {
        let after = match &c.after {
            None => "(released to the GPU Operator's value)".to_string(),
            a => value(a),
        };
        let _ = writeln!(out, "  {}: {} -> {}", c.key, value(&c.before), after);
    }
}

fn header(cols: &[&str]) -> Vec<Vec<String>> {
    vec![cols.iter().map(|c| c.to_string()).collect()]
}

fn policies(out: &mut String, p: &Preview) {
    let mut rows = header(&[
        "POLICY",
        "CHANGE",
        "STRATEGY",
        "NODES",
        "SCHEDULABLE",
        "MIB/CLIENT",
        "READY",
    ]);
    for x in &p.policies {
        rows.push(policy_row(
            &x.name,
            x.change,
            x.before.as_ref(),
            x.after.as_ref(),
        ));
    }
    let _ = writeln!(out, "Policies:");
    table(out, &rows);
    let after = || {
        p.policies
            .iter()
            .filter_map(|x| Some((&x.name, x.after.as_ref()?)))
    };
    if after().any(|(_, a)| !a.mig_geometry.is_empty()) {
        let _ = writeln!(
            out,
            "\nMIG geometry (where each instance goes, per GPU model):"
        );
        for (name, a) in after() {
            for g in &a.mig_geometry {
                let _ = writeln!(out, "  {name}: {g}");
            }
        }
    }
    if after().any(|(_, a)| a.degraded.is_some()) {
        let _ = writeln!(out, "\nDegraded:");
        for (name, a) in after() {
            if let Some(d) = &a.degraded {
                let _ = writeln!(out, "  {name}: {d}");
            }
        }
    }
}

fn nodes(out: &mut String, p: &Preview) {
    if p.nodes.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "\nNodes: {} change, in {} wave(s):",
        p.nodes.len(),
        p.waves.len()
    );
    let mut rows = header(&["NODE", "WAVE", "POLICY", "CONFIG", "MIG", "WORKLOAD"]);
    for n in &p.nodes {
        let (b, a) = (sharing(&n.before), sharing(&n.after));
        let mut row = vec![n.name.clone(), n.wave.to_string()];
        row.extend(b.iter().zip(&a).map(|(b, a)| arrow(b, a)));
        rows.push(row);
    }
    table(out, &rows);
    if p.waves.len() > 1 {
        let _ = writeln!(
            out,
            "\nWaves (each waits for NVIDIA's components to confirm the one before):"
        );
        for (i, w) in p.waves.iter().enumerate() {
            let shown: Vec<&str> = w.iter().take(10).map(String::as_str).collect();
            let tail = match w.len().saturating_sub(10) {
                0 => String::new(),
                more => format!(" and {more} more"),
            };
            let _ = writeln!(out, "  {}: {}{tail}", i + 1, shown.join(", "));
        }
    }
}

fn summary(p: &Preview) -> String {
    if !p.changed {
        return "No changes: the cluster matches the given policies.".to_string();
    }
    let policies = p
        .policies
        .iter()
        .filter(|x| x.change != PolicyChange::Unchanged)
        .count();
    format!(
        "Plan: {policies} policy object(s) and {} node(s) change.",
        p.nodes.len()
    )
}

/// The whole preview as text.
pub fn text(p: &Preview) -> String {
    let mut out = String::new();
    policies(&mut out, p);
    nodes(&mut out, p);
    let k = &p.device_plugin_config_keys;
    keys(
        &mut out,
        "Device-plugin ConfigMap keys",
        &k.added,
        &k.removed,
    );
    let k = &p.mig_layouts;
    keys(
        &mut out,
        "MIG layouts (our mig-parted ConfigMap)",
        &k.added,
        &k.removed,
    );
    let k = &p.claim_templates;
    keys(&mut out, "ResourceClaimTemplates", &k.added, &k.removed);
    let k = &p.device_classes;
    keys(
        &mut out,
        "DeviceClasses (DRA extended resources)",
        &k.added,
        &k.removed,
    );
    let k = &p.node_overlays;
    keys(&mut out, "Karpenter NodeOverlays", &k.added, &k.removed);
    keys(
        &mut out,
        "MIG layouts for pending pods (spec.mig.dynamic)",
        &p.demand_layouts,
        &[],
    );
    let k = &p.spare_taints;
    keys(
        &mut out,
        "Spare taint gpusharing.io/spare:PreferNoSchedule (preferBusyNodes)",
        &k.added,
        &k.removed,
    );
    cluster_policy(&mut out, &p.cluster_policy);
    for a in &p.assumptions {
        let _ = writeln!(out, "\nnote: {a}");
    }
    let _ = writeln!(out, "\n{}", summary(p));
    out
}
