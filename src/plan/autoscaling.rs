//! Autoscaler-visible capacity: Karpenter `NodeOverlay`s that give the instance types a policy's
//! nodes would be launched as the capacity the policy makes them advertise.
//!
//! Karpenter simulates a pending pod on the instance types a NodePool may launch; with GPU
//! sharing the node advertises, say, 32 `nvidia.com/gpu` for 8 GPUs, which Karpenter cannot know
//! before the node exists. A `NodeOverlay` (`karpenter.sh/v1alpha1`) sets extended resources of
//! the instance types its requirements match, replacing the instance type's own value.
//!
//! For each valid device-plugin policy and each NodePool whose nodes it would select, judged per
//! known instance type from the NodePool's template labels and requirements together with the
//! instance type's GPU labels, the policy gets one overlay per capacity class (GPU count and the
//! resources that follow), not one per instance type. Instance types are known from the nodes
//! the cluster runs (GPU Feature Discovery's labels under `node.kubernetes.io/instance-type`)
//! and from an optional admin table for types never seen. Where another actor's overlay already
//! sets one of those resources on a matched instance type, the policy steps aside for that type
//! and says so: an admin's overlay wins whatever the weights (Karpenter v1.8 applied the lowest
//! weight's capacity, kubernetes-sigs/karpenter#2764).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

use crate::api::crd::{AutoscalingStatus, NodeOverlayStatus, NodePoolMatch};
use crate::api::names::{
    LABEL_GPU_COUNT, LABEL_GPU_MEMORY, LABEL_GPU_PRODUCT, LABEL_INSTANCE_TYPE,
    LABEL_KARPENTER_INITIALIZED, LABEL_NODEPOOL, LABEL_POLICY, LABEL_WORKLOAD, MANAGED_BY,
    PROVIDER_COUNT_LABELS, PROVIDER_GPU_LABELS,
};
use crate::nvidia;

use super::backend;
use super::backing::Kind;
use super::facts::{gpu_count, sandbox_resources};
use super::input::{AutoscalingFacts, NodePool, Requirement, Sandbox};
use super::labels::{Labels, selector_matches};
use super::policies::Prepared;
use super::{facts::NodeFacts, input::NodeView};

/// Key of the admin's instance-type table in its ConfigMap.
pub const TABLE_KEY: &str = "instance-types.yaml";
/// The weight our overlays carry unless told otherwise: the lowest Karpenter accepts.
pub const DEFAULT_WEIGHT: i32 = 1;

/// An instance type's GPUs as node labels would say them (GFD's `nvidia.com/gpu.*`, provider
/// GPU labels), how many, and where we learnt them.
#[derive(Debug, Clone, PartialEq)]
pub struct InstanceType {
    pub labels: BTreeMap<String, String>,
    pub gpus: i64,
    /// The name the sandbox device plugin advertises these GPUs under when handed through whole
    /// (`nvidia.com/<name>`, from the PCI device name): learnt from a passthrough node of the
    /// type, or the table's `pciDeviceName`.
    pub pci_name: Option<String>,
    pub source: String,
}

/// One row of the admin's table.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TableRow {
    gpus: i64,
    product: Option<String>,
    #[serde(rename = "memoryMiB")]
    memory_mib: Option<i64>,
    #[serde(default)]
    mig_capable: bool,
    pci_device_name: Option<String>,
}

/// The GPU labels of a node worth keeping for its instance type.
fn gpu_labels(n: &NodeFacts) -> BTreeMap<String, String> {
    n.labels
        .iter()
        .filter(|(k, _)| {
            k.starts_with("nvidia.com/gpu.")
                || *k == "nvidia.com/mig.capable"
                || PROVIDER_GPU_LABELS.contains(k)
        })
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A passthrough VM host's GPUs as the sandbox device plugin advertises them: its one
/// PCI-device-named resource (vGPU types are named `NVIDIA_<type>`) and their count.
fn passthrough_resource(n: &NodeFacts) -> Option<(String, i64)> {
    if n.labels
        .get(LABEL_WORKLOAD)
        .is_none_or(|w| w != "vm-passthrough")
    {
        return None;
    }
    let mut named = sandbox_resources(n)
        .into_iter()
        .filter(|(r, _)| !super::facts::is_vgpu_resource(r));
    let (r, c) = named.next()?;
    // Bounded like GPU Feature Discovery's count: capacity promised to Karpenter is this
    // number times each GPU's share.
    if named.next().is_some() || !(1..=super::facts::MAX_GPUS_PER_NODE).contains(&c) {
        return None;
    }
    Some((r.trim_start_matches("nvidia.com/").to_string(), c))
}

/// The instance types we know the GPUs of: from the nodes the cluster runs (GPU Feature
/// Discovery's labels; a node under the `single` MIG strategy describes its MIG devices there,
/// so it teaches nothing; a passthrough VM host its GPUs' PCI name), then from the admin's
/// table for what no node showed. Errors name the table's rows.
pub fn catalogue(
    nodes: &[NodeView],
    table: Option<&str>,
) -> (BTreeMap<String, InstanceType>, Vec<String>) {
    let mut out = BTreeMap::new();
    // What nodes say, with how many say it and the first to.
    type Votes<'a, K> = BTreeMap<K, (usize, &'a NodeFacts)>;
    // Per type, the passthrough hosts' (PCI name, GPU count).
    let mut passthrough: BTreeMap<&str, Votes<(String, i64)>> = BTreeMap::new();
    // Per type, the nodes' (GPU count, product, memory).
    let mut seen: BTreeMap<&str, Votes<(i64, &str, &str)>> = BTreeMap::new();
    for v in nodes {
        let n: &NodeFacts = &v.facts;
        let Some(t) = n.labels.get(LABEL_INSTANCE_TYPE) else {
            continue;
        };
        if n.labels.get(LABEL_WORKLOAD) == Some("vm-passthrough") {
            // A passthrough host teaches its PCI name and count, or nothing (GFD's labels
            // on it are left from before it was a VM host).
            if let Some(kind) = passthrough_resource(n) {
                passthrough
                    .entry(t)
                    .or_default()
                    .entry(kind)
                    .or_insert((0, n))
                    .0 += 1;
            }
            continue;
        }
        let Some(gpus) = gpu_count(n) else {
            continue;
        };
        let product = n.labels.get(LABEL_GPU_PRODUCT).unwrap_or_default();
        if product.contains("-MIG-") {
            continue;
        }
        let memory = n.labels.get(LABEL_GPU_MEMORY).unwrap_or_default();
        seen.entry(t)
            .or_default()
            .entry((gpus, product, memory))
            .or_insert((0, n))
            .0 += 1;
    }
    for (t, kinds) in seen {
        out.insert(t.to_string(), most_nodes_say(&kinds));
    }
    for (t, kinds) in passthrough {
        // As for GPU Feature Discovery's labels: most hosts decide, a tie goes to fewer GPUs.
        let (&(ref name, gpus), &(_, n)) = kinds
            .iter()
            .max_by_key(|((_, gpus), (votes, _))| (*votes, std::cmp::Reverse(*gpus)))
            .expect("one node at least");
        let name = name.clone();
        out.entry(t.to_string())
            .or_insert_with(|| InstanceType {
                labels: gpu_labels(n),
                gpus,
                pci_name: None,
                source: format!("node {}", n.name),
            })
            .pci_name = Some(name);
    }
    let errors = match table {
        Some(text) => add_table(&mut out, text),
        None => Vec::new(),
    };
    (out, errors)
}

/// What most nodes of one instance type say about its GPUs: node labels can be written by
/// others than GPU Feature Discovery, so one node does not decide for the type. A tie goes to
/// fewer GPUs (capacity promised to Karpenter must not be more than a node has).
fn most_nodes_say(kinds: &BTreeMap<(i64, &str, &str), (usize, &NodeFacts)>) -> InstanceType {
    let total: usize = kinds.values().map(|(votes, _)| votes).sum();
    let (&(gpus, _, _), &(votes, n)) = kinds
        .iter()
        .max_by_key(|((gpus, _, _), (votes, _))| (*votes, std::cmp::Reverse(*gpus)))
        .expect("one node at least");
    let source = if votes == total {
        format!("node {}", n.name)
    } else {
        format!(
            "node {} ({votes} of the type's {total} nodes agree)",
            n.name
        )
    };
    InstanceType {
        labels: gpu_labels(n),
        gpus,
        pci_name: None,
        source,
    }
}

/// The admin's table's rows, for the types no node showed (and the PCI name a node did not).
fn add_table(out: &mut BTreeMap<String, InstanceType>, text: &str) -> Vec<String> {
    let rows = match crate::api::yaml::from_str::<BTreeMap<String, TableRow>>(text) {
        Err(e) => return vec![format!("{TABLE_KEY}: {e}")],
        Ok(rows) => rows,
    };
    let mut errors = Vec::new();
    for (t, row) in rows {
        if row.gpus < 1 {
            errors.push(format!("{TABLE_KEY}: {t}: gpus must be at least 1"));
            continue;
        }
        if row.gpus > super::facts::MAX_GPUS_PER_NODE {
            errors.push(format!(
                "{TABLE_KEY}: {t}: gpus must be at most {}",
                super::facts::MAX_GPUS_PER_NODE
            ));
            continue;
        }
        let mut labels = BTreeMap::from([(LABEL_GPU_COUNT.to_string(), row.gpus.to_string())]);
        if let Some(p) = row.product {
            labels.insert(LABEL_GPU_PRODUCT.to_string(), p);
        }
        if let Some(m) = row.memory_mib {
            labels.insert(LABEL_GPU_MEMORY.to_string(), m.to_string());
        }
        if row.mig_capable {
            labels.insert("nvidia.com/mig.capable".into(), "true".into());
        }
        let it = out.entry(t).or_insert(InstanceType {
            labels,
            gpus: row.gpus,
            pci_name: None,
            source: "table".into(),
        });
        if it.pci_name.is_none() {
            it.pci_name = row.pci_device_name;
        }
    }
    errors
}

/// The labels a node of `pool` launched as instance type `t` would carry, as far as we know
/// them: the template's labels, the NodePool's name, the instance type, what single-valued
/// requirements pin, and the instance type's GPU labels.
fn node_labels(pool: &NodePool, t: &str, it: &InstanceType) -> BTreeMap<String, String> {
    let mut l = it.labels.clone();
    for r in &pool.requirements {
        if r.operator == "In" && r.values.len() == 1 {
            l.entry(r.key.clone())
                .or_insert_with(|| r.values[0].clone());
        }
    }
    l.extend(pool.labels.iter().map(|(k, v)| (k.clone(), v.clone())));
    l.insert(LABEL_NODEPOOL.into(), pool.name.clone());
    l.insert(LABEL_INSTANCE_TYPE.into(), t.into());
    l
}

/// Whether requirements admit a node with `labels`; a key we do not know (zone, capacity
/// type...) is not held against it.
fn admits(reqs: &[Requirement], labels: &BTreeMap<String, String>) -> bool {
    reqs.iter().all(|r| match labels.get(&r.key) {
        Some(v) => r.admits(Some(v)),
        None => {
            !matches!(r.operator.as_str(), "In" | "Exists" | "Gt" | "Lt") || !is_known_key(&r.key)
        }
    })
}

/// Keys whose absence we can judge: the instance type's GPU labels are complete for a type we
/// know.
fn is_known_key(key: &str) -> bool {
    key.starts_with("nvidia.com/gpu.") || PROVIDER_GPU_LABELS.contains(&key)
}

/// What an overlay sets: resource -> quantity.
type Capacity = BTreeMap<String, String>;

/// The resources a node of this instance type advertises under the policy, as a Karpenter
/// capacity map (the policy's backend answers, see [`backend::type_resources`]);
/// `nvidia.com/gpu` is set to 0 when the policy advertises the GPUs under other names (MIG
/// `mixed`, `renameByDefault`, VMs), so Karpenter does not count them twice. `Err` says why it
/// is unknown.
fn overlay_capacity(
    p: &Prepared,
    it: &InstanceType,
    base: Option<&BTreeMap<String, Value>>,
    sandbox: &Sandbox,
) -> Result<Capacity, String> {
    let facts = NodeFacts {
        labels: Labels::from_pairs(
            it.labels
                .iter()
                .map(|(k, v)| (k.as_str().into(), v.as_str().into()))
                .collect(),
        ),
        ..Default::default()
    };
    let gpus = (it.gpus, it.pci_name.as_deref());
    let mut out = backend::type_resources(p, &facts, gpus, base, sandbox)?;
    out.entry(nvidia::GPU_RESOURCE.to_string())
        .or_insert_with(|| "0".into());
    Ok(out)
}

/// One overlay being built: its capacity and what it matches (instance types by name, or, for
/// `by_label`, any type whose provider GPU-count label has `gpus`).
#[derive(Default)]
struct Class {
    gpus: String,
    pools: BTreeSet<String>,
    types: BTreeSet<String>,
}

/// Capacity classes of one policy: (provider count label matched on, or none for types by
/// name; capacity) -> what it covers.
type Classes = BTreeMap<(Option<String>, Capacity), Class>;

/// One planning of the overlays: what every policy reads, and which policy won each
/// (NodePool, instance type) so far (the first in precedence order).
struct Pass<'a> {
    facts: &'a AutoscalingFacts,
    types: BTreeMap<String, InstanceType>,
    base: Option<&'a BTreeMap<String, Value>>,
    sandbox: &'a Sandbox,
    won: BTreeMap<(String, String), String>,
    /// (NodePool, GPU count) -> the first policy that took a type of that count there: in a
    /// NodePool that pins a provider count label, an overlay by that label and one by type
    /// name would both match its types, so one policy takes the whole count.
    won_counts: BTreeMap<(String, i64), String>,
}

/// What one NodePool gave one policy: the types matched, why others were not.
#[derive(Default)]
struct PoolResult {
    matched: Vec<String>,
    why: Vec<String>,
}

impl Pass<'_> {
    /// The earlier policy that already took `t` (or, where the NodePool pins a provider count
    /// label, any type of its GPU count) in `pool`.
    fn won_by(&self, p: &Prepared, pool: &NodePool, t: &str, gpus: i64) -> Option<&String> {
        if let Some(w) = self.won.get(&(pool.name.clone(), t.to_string())) {
            return Some(w);
        }
        if pinned_counts(pool).is_empty() {
            return None;
        }
        self.won_counts
            .get(&(pool.name.clone(), gpus))
            .filter(|w| **w != p.name)
    }

    /// The instance types of `pool` the policy selects, added to its classes; the NodePool's
    /// line of the status.
    fn pool(
        &mut self,
        p: &Prepared,
        pool: &NodePool,
        st: &mut AutoscalingStatus,
        classes: &mut Classes,
    ) -> NodePoolMatch {
        let mut r = PoolResult::default();
        let types = std::mem::take(&mut self.types);
        for (t, it) in &types {
            let labels = node_labels(pool, t, it);
            self.candidate(p, pool, (None, t), it, &labels, st, classes, &mut r);
        }
        self.types = types;
        for (key, n) in pinned_counts(pool) {
            let it = InstanceType {
                labels: BTreeMap::from([
                    (LABEL_GPU_COUNT.to_string(), n.to_string()),
                    (key.to_string(), n.to_string()),
                ]),
                gpus: n,
                pci_name: None,
                source: format!("NodePool {}'s {key}", pool.name),
            };
            let mut labels = node_labels(pool, "", &it);
            labels.remove(LABEL_INSTANCE_TYPE);
            let name = format!("{key}={n}");
            self.candidate(
                p,
                pool,
                (Some(key), &name),
                &it,
                &labels,
                st,
                classes,
                &mut r,
            );
        }
        let reason = if !r.matched.is_empty() {
            let why = r.why.iter().map(|w| format!("; {w}"));
            format!(
                "instance types {}{}",
                r.matched.join(", "),
                why.collect::<String>()
            )
        } else if !r.why.is_empty() {
            r.why.join("; ")
        } else {
            not_selected(p, pool, &self.types)
        };
        NodePoolMatch {
            name: pool.name.clone(),
            matched: !r.matched.is_empty(),
            reason,
        }
    }

    /// One instance type of `pool` (by name, or by a provider count label: `(Some(key), "key=N")`)
    /// for the policy: selected, not won by an earlier policy, capacity known, not left to
    /// another actor's overlay: then into its class.
    #[allow(clippy::too_many_arguments)]
    fn candidate(
        &mut self,
        p: &Prepared,
        pool: &NodePool,
        (by_label, t): (Option<&str>, &str),
        it: &InstanceType,
        labels: &BTreeMap<String, String>,
        st: &mut AutoscalingStatus,
        classes: &mut Classes,
        r: &mut PoolResult,
    ) {
        if !admits(&pool.requirements, labels) || !selector_matches(&p.spec.node_selector, labels) {
            return;
        }
        if let Some(w) = self.won_by(p, pool, t, it.gpus) {
            r.why.push(format!("{t}: won by policy {w}"));
            return;
        }
        if by_label.is_some() && p.mig().is_some() {
            r.why.push(format!(
                "{t}: MIG capacity needs the GPU model, which the count label does not give"
            ));
            return;
        }
        let cap = match overlay_capacity(p, it, self.base, self.sandbox) {
            Ok(cap) => cap,
            Err(why) => {
                r.why.push(format!("{t}: {why}"));
                return;
            }
        };
        self.won
            .insert((pool.name.clone(), t.to_string()), p.name.clone());
        self.won_counts
            .entry((pool.name.clone(), it.gpus))
            .or_insert_with(|| p.name.clone());
        if let Some(o) = self.facts.foreign_overlays.iter().find(|o| {
            admits(&o.requirements, labels) && o.resources.iter().any(|r| cap.contains_key(r))
        }) {
            let shared: Vec<&str> = o
                .resources
                .iter()
                .filter(|r| cap.contains_key(*r))
                .map(String::as_str)
                .collect();
            st.conflicts.push(format!(
                "NodeOverlay {} (weight {}) sets {} on {t} in NodePool {}: left to it",
                o.name,
                o.weight,
                shared.join(", "),
                pool.name
            ));
            return;
        }
        let c = classes
            .entry((by_label.map(str::to_string), cap))
            .or_default();
        c.gpus = it.gpus.to_string();
        c.pools.insert(pool.name.clone());
        if by_label.is_none() {
            c.types.insert(t.to_string());
        }
        r.matched.push(t.to_string());
    }
}

/// The GPU counts a NodePool pins through a provider's count label (`In` values): its nodes
/// have that many GPUs whatever instance type the provider picks, known to us or not.
fn pinned_counts(pool: &NodePool) -> Vec<(&'static str, i64)> {
    let mut out = Vec::new();
    for key in PROVIDER_COUNT_LABELS {
        for r in pool
            .requirements
            .iter()
            .filter(|r| r.key == key && r.operator == "In")
        {
            out.extend(
                r.values
                    .iter()
                    .filter_map(|v| v.parse().ok())
                    .map(|n| (key, n)),
            );
        }
    }
    out
}

/// The overlays of every policy (by name, as objects to apply), and each policy's
/// `status.autoscaling`, for the policies in precedence order.
pub fn plan(
    prepared: &[Prepared],
    nodes: &[NodeView],
    facts: &AutoscalingFacts,
    base: Option<&BTreeMap<String, Value>>,
    sandbox: &Sandbox,
) -> (BTreeMap<String, Value>, BTreeMap<String, AutoscalingStatus>) {
    let (types, table_errors) = catalogue(nodes, facts.table.as_deref());
    let mut pass = Pass {
        facts,
        types,
        base,
        sandbox,
        won: BTreeMap::new(),
        won_counts: BTreeMap::new(),
    };
    let mut overlays = BTreeMap::new();
    let mut statuses = BTreeMap::new();
    for p in prepared {
        if !p.errors.is_empty() || p.kind() == Kind::Dra && p.extended().is_none() {
            continue;
        }
        let mut st = AutoscalingStatus {
            conflicts: table_errors.clone(),
            launched_nodes: p.extended().map(|x| {
                let names: Vec<&str> = x.names.iter().map(String::as_str).collect();
                launched_dra_nodes(&names.join(", "))
            }),
            ..Default::default()
        };
        let mut classes = Classes::new();
        for pool in &facts.node_pools {
            let m = pass.pool(p, pool, &mut st, &mut classes);
            st.node_pools.push(m);
        }
        let mut per_count = BTreeMap::<String, usize>::new();
        for c in classes.values() {
            *per_count.entry(c.gpus.clone()).or_default() += 1;
        }
        for ((by_label, cap), c) in classes {
            // One overlay per GPU count; a second capacity for the same count (another GPU
            // model under MIG, or types matched by a provider label) gets a hash in the name.
            let mut name = format!("gpusharing-{}-{}gpu", p.name, c.gpus);
            if per_count[&c.gpus] > 1 {
                let h = nvidia::content_hash(&json!([by_label, cap]));
                name = format!("{name}-{}", &h[..6]);
            }
            let object =
                overlay_object(&name, &p.name, &c, by_label.as_deref(), &cap, facts.weight);
            overlays.insert(name.clone(), object);
            st.overlays.push(NodeOverlayStatus {
                name,
                capacity: cap,
                instance_types: c.types.into_iter().collect(),
                node_pools: c.pools.into_iter().collect(),
                gpu_count_label: by_label.map(|k| format!("{k}={}", c.gpus)),
            });
        }
        statuses.insert(p.name.clone(), st);
    }
    (overlays, statuses)
}

/// What becomes of a node Karpenter launches for a pool served through extended resources.
fn launched_dra_nodes(name: &str) -> String {
    format!(
        "each comes up on the device plugin, which registers {name}: Karpenter initializes a NodeClaim only once the resources its pods asked for are registered, and a node served by the DRA driver never registers them (kubernetes-sigs/karpenter#3228). The node moves to the DRA driver once Karpenter has initialized it ({LABEL_KARPENTER_INITIALIZED}=true) and no device-plugin pod runs on it. The overlay's capacity is what kube-scheduler can place through the DRA driver on a moved node: pods asking one {name} each (a pod asking k needs k distinct GPUs)"
    )
}

/// Why no known instance type of `pool` is selected by the policy.
fn not_selected(p: &Prepared, pool: &NodePool, types: &BTreeMap<String, InstanceType>) -> String {
    if types.is_empty() {
        return "no instance type with GPUs is known: no node shows one, and the instance-type table lists none".into();
    }
    let admitted: Vec<&String> = types
        .iter()
        .filter(|(t, it)| admits(&pool.requirements, &node_labels(pool, t, it)))
        .map(|(t, _)| t)
        .collect();
    if admitted.is_empty() {
        return format!(
            "its requirements admit none of the known GPU instance types ({})",
            types.keys().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    let sel = &p.spec.node_selector;
    let missing: Vec<String> = sel
        .match_labels
        .iter()
        .flatten()
        .filter(|(k, v)| pool.labels.get(*k) != Some(*v) && !is_known_key(k))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if missing.is_empty() {
        "the selector matches none of its instance types' labels".into()
    } else {
        format!("its template labels lack {}", missing.join(", "))
    }
}

/// A NodeOverlay object as we apply it.
fn overlay_object(
    name: &str,
    policy: &str,
    c: &Class,
    by_label: Option<&str>,
    cap: &Capacity,
    weight: i32,
) -> Value {
    let types = match by_label {
        Some(key) => json!({"key": key, "operator": "In", "values": [c.gpus]}),
        None => json!({"key": LABEL_INSTANCE_TYPE, "operator": "In", "values": c.types}),
    };
    json!({
        "apiVersion": "karpenter.sh/v1alpha1",
        "kind": "NodeOverlay",
        "metadata": {
            "name": name,
            "labels": {MANAGED_BY.0: MANAGED_BY.1, LABEL_POLICY: policy},
        },
        "spec": {
            "requirements": [
                {"key": LABEL_NODEPOOL, "operator": "In", "values": c.pools},
                types,
            ],
            "capacity": cap,
            "weight": weight,
        },
    })
}
