//! The readiness taint (opt-in, `run --readiness-taint`): admins register GPU nodes with a
//! `NoSchedule` taint, and the operator removes it once the node's sharing config is confirmed
//! (or, for a node no policy selects, once GPU Feature Discovery has labelled it), so no pod
//! lands on a GPU before its sharing mode is in place.

use std::collections::BTreeMap;

/// The readiness taint as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReadinessTaint {
    /// The taint key.
    pub key: String,
    /// The GPU Operator's DaemonSet tolerations (`ClusterPolicy.spec.daemonsets.tolerations`):
    /// where they do not tolerate a node's taint, its driver, device plugin and GFD never start
    /// there, so the operator refuses to act on the taint and says so.
    pub tolerations: Vec<Toleration>,
    /// Nodes that carry it, with that taint as the node has it (admins choose value and effect).
    pub tainted: BTreeMap<String, Taint>,
}

impl ReadinessTaint {
    /// Whether the GPU Operator's DaemonSets tolerate the taint on `node` (false for a node
    /// without it).
    pub fn tolerated_on(&self, node: &str) -> bool {
        self.tainted
            .get(node)
            .is_some_and(|t| self.tolerations.iter().any(|tol| tol.tolerates(t)))
    }

    /// Whether the DaemonSets fail to tolerate the taint: on some node that carries it, or,
    /// while no node does, for the documented `NoSchedule` taint with any value (no toleration
    /// of the key and effect at all).
    pub fn untolerated(&self) -> bool {
        if self.tainted.is_empty() {
            return !self.tolerations.iter().any(|tol| {
                tol.matches_key_and_effect(&self.key, "NoSchedule")
                    && matches!(tol.operator.as_str(), "" | "Equal" | "Exists")
            });
        }
        self.tainted.keys().any(|n| !self.tolerated_on(n))
    }
}

/// A node taint, as far as tolerations look at it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Taint {
    pub key: String,
    pub value: String,
    pub effect: String,
}

/// A pod toleration (`core/v1` `Toleration`; `tolerationSeconds` does not matter here).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(default)]
pub struct Toleration {
    pub key: String,
    pub operator: String,
    pub value: String,
    pub effect: String,
}

impl Toleration {
    fn matches_key_and_effect(&self, key: &str, effect: &str) -> bool {
        (self.effect.is_empty() || self.effect == effect)
            && (self.key.is_empty() || self.key == key)
    }

    /// Kubernetes' `Toleration.ToleratesTaint`: an empty effect matches every effect, an empty
    /// key (only valid with `Exists`) every key; `Exists` matches any value, `Equal` (the
    /// default) only the same value; any other operator matches nothing here.
    pub fn tolerates(&self, taint: &Taint) -> bool {
        if !self.matches_key_and_effect(&taint.key, &taint.effect) {
            return false;
        }
        match self.operator.as_str() {
            "" | "Equal" => self.value == taint.value,
            "Exists" => true,
            _ => false,
        }
    }
}

/// The tolerations of a `spec.daemonsets.tolerations` value (entries that do not parse as a
/// toleration are left out: they tolerate nothing).
pub fn tolerations(value: Option<&serde_json::Value>) -> Vec<Toleration> {
    value
        .and_then(|v| v.as_array())
        .map(|list| {
            list.iter()
                .filter_map(|t| serde_json::from_value(t.clone()).ok())
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn readiness(tolerations: serde_json::Value, tainted: &[(&str, &str, &str)]) -> ReadinessTaint {
        ReadinessTaint {
            key: KEY.into(),
            tolerations: super::tolerations(Some(&tolerations)),
            tainted: tainted
                .iter()
                .map(|(n, value, effect)| {
                    let t = Taint {
                        key: KEY.into(),
                        value: value.to_string(),
                        effect: effect.to_string(),
                    };
                    (n.to_string(), t)
                })
                .collect(),
        }
    }

    const KEY: &str = "gpusharing.io/unconfigured";

    #[test]
    fn tolerations_of_the_gpu_operator_daemonsets() {
        let no_value = [("n", "", "NoSchedule")];
        let gpu_only =
            json!([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]);
        assert!(!readiness(gpu_only.clone(), &no_value).tolerated_on("n"));
        assert!(readiness(gpu_only, &[]).untolerated());
        assert!(!readiness(json!(null), &no_value).tolerated_on("n"));
        let ours = json!([{"key": KEY, "operator": "Exists", "effect": "NoSchedule"}]);
        assert!(readiness(ours.clone(), &no_value).tolerated_on("n"));
        assert!(readiness(ours.clone(), &[("n", "anything", "NoSchedule")]).tolerated_on("n"));
        assert!(!readiness(ours.clone(), &[]).untolerated());
        assert!(!readiness(ours, &no_value).tolerated_on("other-node"));
        let everything = json!([{"operator": "Exists"}]);
        assert!(readiness(everything, &[("n", "x", "NoSchedule")]).tolerated_on("n"));
        let wrong_effect = json!([{"key": KEY, "operator": "Exists", "effect": "NoExecute"}]);
        assert!(!readiness(wrong_effect.clone(), &no_value).tolerated_on("n"));
        assert!(readiness(wrong_effect, &[]).untolerated());
    }

    /// `operator: Equal` (or no operator) tolerates only the same value, as the scheduler and
    /// the DaemonSet controller decide (`k8s.io/api/core/v1` `Toleration.ToleratesTaint`).
    #[test]
    fn equal_tolerations_compare_the_value() {
        let equal_true = json!([{"key": KEY, "value": "true"}]);
        let r = readiness(
            equal_true.clone(),
            &[
                ("a", "true", "NoSchedule"),
                ("b", "", "NoSchedule"),
                ("c", "false", "NoSchedule"),
            ],
        );
        assert!(r.tolerated_on("a"));
        assert!(!r.tolerated_on("b"), "no value is not the value 'true'");
        assert!(!r.tolerated_on("c"));
        assert!(r.untolerated());
        let only_a = readiness(equal_true, &[("a", "true", "NoSchedule")]);
        assert!(!only_a.untolerated());
        let equal_empty = json!([{"key": KEY, "operator": "Equal", "effect": "NoSchedule"}]);
        let r = readiness(
            equal_empty,
            &[("a", "", "NoSchedule"), ("b", "true", "NoSchedule")],
        );
        assert!(r.tolerated_on("a"));
        assert!(!r.tolerated_on("b"));
        // An empty effect matches every effect; an unknown operator tolerates nothing.
        let any_effect = json!([{"key": KEY, "operator": "Exists"}]);
        assert!(readiness(any_effect, &[("a", "v", "NoExecute")]).tolerated_on("a"));
        let lt = json!([{"key": KEY, "operator": "Lt", "value": "5"}]);
        assert!(!readiness(lt, &[("a", "1", "NoSchedule")]).tolerated_on("a"));
    }
}
