//! Which pending pods count as demand for `spec.mig.dynamic`, before anything else reads them.
//!
//! Pending pods are written by tenants: any pod author can ask for any `nvidia.com/mig-*` name
//! and select on any node label. Before demand planning (and before their label keys reach the
//! node cache's filter, where each new key means listing every node again) a pod is admitted
//! only when:
//! - some dynamic policy's `namespaceSelector` selects its namespace (a policy without one
//!   selects every namespace);
//! - every profile it asks for is one some dynamic policy's catalogue can offer (a layout of
//!   NVIDIA's mig-parted config or a custom layout): a bogus `mig-9g.999gb` is nobody's demand;
//! - the label keys it selects on fit under [`MAX_DEMAND_LABEL_KEYS`] keys beyond the policies'
//!   own;
//! - it is among the first [`MAX_DEMAND_PODS`], highest priority then oldest first.
//!
//! What the caps leave out is reported on every dynamic policy's status
//! ([`crate::api::crd::IgnoredDemand`]). Pure and deterministic.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use crate::api::crd::{GpuSharingPolicy, IgnoredDemand, Mig};
use crate::nvidia;

use super::input::PendingPod;
use super::labels::{LabelFilter, selector_matches};

/// At most this many pending pods are planned for in a pass.
pub const MAX_DEMAND_PODS: usize = 2000;
/// At most this many node label keys, besides the policies' own selector keys, come from
/// pending pods' node selectors and affinity.
pub const MAX_DEMAND_LABEL_KEYS: usize = 32;

/// Why pods were left out of demand by a cap.
pub const TOO_MANY_PENDING_PODS: &str = "TooManyPendingPods";
pub const TOO_MANY_LABEL_KEYS: &str = "TooManyLabelKeys";

/// The pods admitted as demand (sorted by id), the node label keys they select on, and what the
/// caps left out.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Admitted {
    pub pods: Vec<PendingPod>,
    pub keys: BTreeSet<String>,
    pub ignored: Vec<IgnoredDemand>,
}

/// Namespace -> its labels; `None` when the namespaces cannot be read (then a policy with a
/// `namespaceSelector` selects none).
pub type NamespaceLabels = Option<BTreeMap<String, BTreeMap<String, String>>>;

/// The dynamic policies' MIG specs.
fn dynamic_migs(policies: &[GpuSharingPolicy]) -> impl Iterator<Item = (&GpuSharingPolicy, &Mig)> {
    policies.iter().filter_map(|p| {
        let m = p.spec.mig.as_ref()?;
        m.dynamic.as_ref().map(|_| (p, m))
    })
}

/// The profiles (as pods ask for them: `nvidia.com/mig-<this>`) some layout of some dynamic
/// policy's catalogue can create, on any GPU model: named layouts are looked up in `base`
/// (NVIDIA's mig-parted config), custom ones read directly.
pub fn offered_profiles(
    policies: &[GpuSharingPolicy],
    base: &BTreeMap<String, serde_json::Value>,
) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut add = |profile: &str| {
        let resource = nvidia::mig_resource(profile);
        out.insert(resource.trim_start_matches("nvidia.com/mig-").to_string());
    };
    for (_, mig) in dynamic_migs(policies) {
        let named = mig
            .layout
            .iter()
            .chain(mig.dynamic.iter().flat_map(|d| &d.layouts));
        for layout in named {
            for p in nvidia::layout_profiles(&mig.with_layout(layout))
                .into_iter()
                .flatten()
            {
                add(&p);
            }
            let entries = base.get(layout).and_then(|v| v.as_array());
            for e in entries.into_iter().flatten() {
                let devices = e.get("mig-devices").and_then(|d| d.as_object());
                for p in devices.into_iter().flat_map(|d| d.keys()) {
                    add(p);
                }
            }
        }
        if mig.custom_layout.is_some() {
            for p in nvidia::layout_profiles(mig).into_iter().flatten() {
                add(&p);
            }
        }
    }
    out
}

/// Whether dynamic policy `mig` takes demand from a namespace with `labels` (`None`: labels
/// unknown).
pub fn selects_namespace(mig: &Mig, labels: Option<&BTreeMap<String, String>>) -> bool {
    match mig
        .dynamic
        .as_ref()
        .and_then(|d| d.namespace_selector.as_ref())
    {
        None => true,
        Some(sel) => labels.is_some_and(|l| selector_matches(sel, l)),
    }
}

/// What admission reads besides the policies and the pods, asked for only when some policy is
/// dynamic and some pod pending: NVIDIA's named MIG layouts, and the namespaces' labels.
pub struct Sources<B, N> {
    pub mig_configs: B,
    pub namespaces: N,
}

/// The node label keys pending pods may bring into a pass beyond those the policies select on
/// and the node cache keeps anyway. They list nothing again (the nodes a dynamic policy
/// selects keep every label), but each is judged against every such node, so a pass judges
/// at most [`MAX_DEMAND_LABEL_KEYS`] of them.
pub struct KeyBudget<'a> {
    /// The policies' selector keys (free).
    pub policy: &'a BTreeSet<String>,
    /// The node cache's filter now (what it keeps on every node is free).
    pub filter: &'a LabelFilter,
}

impl KeyBudget<'_> {
    fn free(&self, key: &str) -> bool {
        self.policy.contains(key) || self.filter.keeps(key)
    }
}

/// Admits the pending pods that may count as demand (see the module's documentation) and
/// gives each its namespace's labels.
pub fn admit<B, N>(
    policies: &[GpuSharingPolicy],
    sources: Sources<B, N>,
    budget: &KeyBudget,
    pods: Vec<PendingPod>,
) -> Admitted
where
    B: FnOnce() -> BTreeMap<String, serde_json::Value>,
    N: FnOnce() -> NamespaceLabels,
{
    let migs: Vec<&Mig> = dynamic_migs(policies).map(|(_, m)| m).collect();
    if migs.is_empty() || pods.is_empty() {
        return Admitted::default();
    }
    let offered = offered_profiles(policies, &(sources.mig_configs)());
    let namespaces = (sources.namespaces)();
    let ns_labels = |p: &PendingPod| {
        let ns = p.id.split_once('/').map_or("", |(ns, _)| ns);
        // A namespace the cache has not seen has no labels to judge: unknown, not empty.
        namespaces.as_ref().and_then(|all| all.get(ns).cloned())
    };
    let mut candidates: Vec<PendingPod> = pods
        .into_iter()
        .filter(|p| p.profiles.keys().all(|k| offered.contains(k)))
        .filter_map(|mut p| {
            let labels = ns_labels(&p);
            if !migs.iter().any(|m| selects_namespace(m, labels.as_ref())) {
                return None;
            }
            p.namespace_labels = labels;
            Some(p)
        })
        .collect();
    candidates.sort_by(|a, b| {
        (Reverse(a.priority), a.since, &a.id).cmp(&(Reverse(b.priority), b.since, &b.id))
    });
    let mut out = Admitted::default();
    let over = candidates.len().saturating_sub(MAX_DEMAND_PODS);
    candidates.truncate(MAX_DEMAND_PODS);
    let mut over_keys = 0;
    let mut spent = 0;
    for p in candidates {
        let new: BTreeSet<&String> = p
            .label_keys()
            .filter(|k| !budget.free(k) && !out.keys.contains(*k))
            .collect();
        if spent + new.len() > MAX_DEMAND_LABEL_KEYS {
            over_keys += 1;
            continue;
        }
        spent += new.len();
        out.keys.extend(
            p.label_keys()
                .filter(|k| !budget.policy.contains(*k))
                .cloned(),
        );
        out.pods.push(p);
    }
    if over > 0 {
        out.ignored.push(IgnoredDemand {
            reason: TOO_MANY_PENDING_PODS.into(),
            pods: over as i64,
            message: format!(
                "{over} pending pod(s) beyond the {MAX_DEMAND_PODS} planned per pass (highest priority, then oldest, first)"
            ),
        });
    }
    if over_keys > 0 {
        out.ignored.push(IgnoredDemand {
            reason: TOO_MANY_LABEL_KEYS.into(),
            pods: over_keys,
            message: format!(
                "{over_keys} pending pod(s) select on node labels beyond the {MAX_DEMAND_LABEL_KEYS} keys a pass judges besides the policies' own"
            ),
        });
    }
    out.pods.sort_by(|a, b| a.id.cmp(&b.id));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::input::Requirement;

    /// A dynamic MIG policy `name` selecting its own profile, with `dynamic` lines under
    /// `dynamic`.
    fn policy(name: &str, dynamic: &str) -> GpuSharingPolicy {
        crate::plan::testing::policy_spec(
            name,
            &format!(
                "  nodeSelector: {{matchLabels: {{gpusharing.io/profile: {name}}}}}\n  strategy: mig\n  mig:\n    migStrategy: mixed\n    layout: all-7g.80gb\n    dynamic:\n      layouts: [all-1g.10gb, all-balanced]\n{dynamic}"
            ),
        )
    }

    fn pod(id: &str, profile: &str, priority: i32, since: i64) -> PendingPod {
        PendingPod {
            id: id.into(),
            priority,
            since,
            profiles: [(profile.to_string(), 1)].into(),
            ..Default::default()
        }
    }

    /// The sources as plain values.
    fn src<'a>(
        base: &'a BTreeMap<String, serde_json::Value>,
        ns: &'a NamespaceLabels,
    ) -> Sources<
        impl FnOnce() -> BTreeMap<String, serde_json::Value> + 'a,
        impl FnOnce() -> NamespaceLabels + 'a,
    > {
        Sources {
            mig_configs: move || base.clone(),
            namespaces: move || ns.clone(),
        }
    }

    /// [`admit`] with NVIDIA's default MIG configs, `ns` as the namespaces, and a node cache
    /// that keeps the policies' keys only.
    fn admit_with(
        policies: &[GpuSharingPolicy],
        ns: &NamespaceLabels,
        policy: &BTreeSet<String>,
        pods: Vec<PendingPod>,
    ) -> Admitted {
        let base = crate::nvidia::default_mig_configs();
        let filter = LabelFilter::new(policy.clone());
        let budget = KeyBudget {
            policy,
            filter: &filter,
        };
        admit(policies, src(&base, ns), &budget, pods)
    }

    fn ids(a: &Admitted) -> Vec<&str> {
        a.pods.iter().map(|p| p.id.as_str()).collect()
    }

    fn namespaces(of: &[(&str, &str)]) -> NamespaceLabels {
        Some(
            of.iter()
                .map(|(ns, tenant)| {
                    (
                        ns.to_string(),
                        [("tenant".to_string(), tenant.to_string())].into(),
                    )
                })
                .collect(),
        )
    }

    /// Profiles come from the catalogue's layouts as NVIDIA's config defines them (the
    /// balanced layout's 2g and 3g too), never from what pods ask for.
    #[test]
    fn offered_profiles_come_from_the_catalogue() {
        let base = crate::nvidia::default_mig_configs();
        let offered = offered_profiles(&[policy("a", "")], &base);
        for p in ["1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"] {
            assert!(offered.contains(p), "{p} in {offered:?}");
        }
        assert!(!offered.contains("9g.999gb"));
        assert!(offered_profiles(&[], &base).is_empty());
    }

    /// A bogus profile, or any pod while no policy is dynamic, is nobody's demand and adds no
    /// label key to the node cache.
    #[test]
    fn bogus_profiles_and_no_dynamic_policy_admit_nothing() {
        let mut bogus = pod("t/bogus", "9g.999gb", 0, 1);
        bogus.node_selector = [("tenant-key-1".to_string(), "x".to_string())].into();
        let good = pod("ml/good", "1g.10gb", 0, 1);
        let none = BTreeSet::new();
        let a = admit_with(
            &[policy("a", "")],
            &None,
            &none,
            vec![bogus.clone(), good.clone()],
        );
        assert_eq!(ids(&a), ["ml/good"]);
        assert!(a.keys.is_empty());
        let mut mig: GpuSharingPolicy = policy("a", "");
        mig.spec.mig.as_mut().unwrap().dynamic = None;
        let a = admit_with(&[mig], &None, &none, vec![bogus, good]);
        assert!(a.pods.is_empty() && a.keys.is_empty());
    }

    /// A policy with a namespaceSelector admits pods of the namespaces it selects only, none
    /// when namespaces cannot be read; the pod carries its namespace's labels on.
    #[test]
    fn namespace_selector_admits_selected_namespaces_only() {
        let p = policy(
            "a",
            "      namespaceSelector: {matchLabels: {tenant: ml}}\n",
        );
        let pods = vec![pod("ml/p", "1g.10gb", 0, 1), pod("web/p", "1g.10gb", 0, 1)];
        let none = BTreeSet::new();
        let ns = namespaces(&[("ml", "ml"), ("web", "web")]);
        let a = admit_with(std::slice::from_ref(&p), &ns, &none, pods.clone());
        assert_eq!(ids(&a), ["ml/p"]);
        assert_eq!(a.pods[0].namespace_labels.as_ref().unwrap()["tenant"], "ml");
        assert!(
            admit_with(std::slice::from_ref(&p), &None, &none, pods.clone())
                .pods
                .is_empty()
        );
        // Another dynamic policy without a selector takes every namespace.
        let a = admit_with(&[p, policy("b", "")], &ns, &none, pods);
        assert_eq!(ids(&a), ["ml/p", "web/p"]);
    }

    /// Only so many label keys come from pods (the policies' own do not count): pods that
    /// would add more are left out and reported; the highest priority, then oldest, go first.
    #[test]
    fn label_keys_from_pods_are_capped() {
        let policy_keys: BTreeSet<String> = ["shared".to_string()].into();
        let mut pods: Vec<PendingPod> = (0..MAX_DEMAND_LABEL_KEYS + 5)
            .map(|i| {
                let mut p = pod(&format!("t/p{i:03}"), "1g.10gb", 0, i as i64);
                p.affinity = vec![vec![Requirement {
                    key: format!("key-{i}"),
                    operator: "Exists".into(),
                    values: vec![],
                }]];
                p.node_selector = [("shared".to_string(), "x".to_string())].into();
                p
            })
            .collect();
        // The newest pod has the highest priority: it goes first.
        pods.last_mut().unwrap().priority = 1000;
        let a = admit_with(&[policy("a", "")], &None, &policy_keys, pods);
        assert_eq!(a.keys.len(), MAX_DEMAND_LABEL_KEYS);
        assert!(!a.keys.contains("shared"));
        assert_eq!(a.pods.len(), MAX_DEMAND_LABEL_KEYS);
        assert!(ids(&a).contains(&format!("t/p{:03}", MAX_DEMAND_LABEL_KEYS + 4).as_str()));
        assert_eq!(a.ignored.len(), 1);
        assert_eq!(a.ignored[0].reason, TOO_MANY_LABEL_KEYS);
        assert_eq!(a.ignored[0].pods, 5);
    }

    /// The cap counts the keys of one pass: a key the node cache keeps on every node is free,
    /// and a pod with one is admitted when the new keys already reached the cap.
    #[test]
    fn keys_the_cache_keeps_are_free_and_the_cap_is_per_pass() {
        let policy: BTreeSet<String> = ["shared".to_string()].into();
        let mut kept = policy.clone();
        kept.insert("kept".into());
        let filter = LabelFilter::new(kept);
        let budget = KeyBudget {
            policy: &policy,
            filter: &filter,
        };
        let with_key = |id: &str, key: &str| {
            let mut p = pod(id, "1g.10gb", 0, 1);
            p.node_selector = [(key.to_string(), "x".to_string())].into();
            p
        };
        let base = crate::nvidia::default_mig_configs();
        let mut pods: Vec<PendingPod> = (0..MAX_DEMAND_LABEL_KEYS)
            .map(|i| with_key(&format!("t/a{i:02}"), &format!("new-{i}")))
            .collect();
        pods.push(with_key("t/b-new", "one-too-many"));
        pods.push(with_key("t/c-kept", "kept"));
        let a = admit(&[policy_of("a")], src(&base, &None), &budget, pods.clone());
        assert!(ids(&a).contains(&"t/c-kept") && !ids(&a).contains(&"t/b-new"));
        assert_eq!(a.pods.len(), MAX_DEMAND_LABEL_KEYS + 1);
        assert_eq!(a.ignored[0].reason, TOO_MANY_LABEL_KEYS);
        // The next pass starts afresh (nothing of the last one is spent).
        let again = admit(
            &[policy_of("a")],
            src(&base, &None),
            &budget,
            pods.split_off(30),
        );
        assert_eq!(ids(&again).len(), 4, "{:?}", again.ignored);
    }

    fn policy_of(name: &str) -> GpuSharingPolicy {
        policy(name, "")
    }

    /// At most MAX_DEMAND_PODS are planned, highest priority then oldest first; extreme
    /// priorities sort without overflow.
    #[test]
    fn pods_per_pass_are_capped_by_priority_then_age() {
        let mut pods: Vec<PendingPod> = (0..MAX_DEMAND_PODS + 3)
            .map(|i| pod(&format!("t/p{i:05}"), "1g.10gb", 0, i as i64))
            .collect();
        pods[MAX_DEMAND_PODS + 2].priority = i32::MAX;
        pods[1].priority = i32::MIN;
        let a = admit_with(&[policy("a", "")], &None, &BTreeSet::new(), pods);
        assert_eq!(a.pods.len(), MAX_DEMAND_PODS);
        let admitted: BTreeSet<&str> = ids(&a).into_iter().collect();
        assert!(admitted.contains(format!("t/p{:05}", MAX_DEMAND_PODS + 2).as_str()));
        assert!(
            !admitted.contains("t/p00001"),
            "the lowest priority goes last"
        );
        assert!(!admitted.contains(format!("t/p{:05}", MAX_DEMAND_PODS + 1).as_str()));
        assert_eq!(a.ignored[0].reason, TOO_MANY_PENDING_PODS);
        assert_eq!(a.ignored[0].pods, 3);
    }
}
