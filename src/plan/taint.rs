//! The readiness taint (opt-in, `run --readiness-taint`): admins register GPU nodes with a
//! `NoSchedule` taint, and the operator removes it once the node's sharing config is confirmed
//! (or, for a node no policy selects, once GPU Feature Discovery has labelled it), so no pod
//! lands on a GPU before its sharing mode is in place.

use std::collections::BTreeSet;

use crate::api::names::LABEL_GFD_TIMESTAMP;
use crate::api::state::NodeState;

use super::NodeFacts;

/// The readiness taint as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReadinessTaint {
    /// The taint key.
    pub key: String,
    /// Whether the GPU Operator's DaemonSets (`ClusterPolicy.spec.daemonsets.tolerations`)
    /// tolerate it: if not, its driver, device plugin and GFD never start on a tainted node, so
    /// the operator refuses to act on the taint and says so.
    pub tolerated: bool,
    /// Nodes that carry it.
    pub tainted: BTreeSet<String>,
}

/// Whether a toleration list (`spec.daemonsets.tolerations`) tolerates a `NoSchedule` taint
/// with `key` (whatever its value: admins choose it, `operator: Exists` is what we document).
pub fn tolerates(tolerations: Option<&serde_json::Value>, key: &str) -> bool {
    let Some(list) = tolerations.and_then(|t| t.as_array()) else {
        return false;
    };
    list.iter().any(|t| {
        let s = |f: &str| t.get(f).and_then(|v| v.as_str()).unwrap_or_default();
        let effect_ok = matches!(s("effect"), "" | "NoSchedule");
        let key_ok = match s("operator") {
            "Exists" => s("key").is_empty() || s("key") == key,
            "" | "Equal" => s("key") == key,
            _ => false,
        };
        effect_ok && key_ok
    })
}

/// Whether a tainted node may lose the taint: its policy's config is confirmed (`Applied`), or
/// no policy governs it and GFD has labelled it (selectors match on GFD labels that do not exist
/// before). A node a policy governs but cannot configure keeps it.
pub fn ready_to_untaint(n: &NodeFacts, governed: bool, state: Option<NodeState>) -> bool {
    if governed {
        state == Some(NodeState::Applied)
    } else {
        n.labels.get(LABEL_GFD_TIMESTAMP).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tolerations_of_the_gpu_operator_daemonsets() {
        let key = "gpusharing.io/unconfigured";
        let gpu_only =
            json!([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]);
        assert!(!tolerates(Some(&gpu_only), key));
        assert!(!tolerates(None, key));
        let ours = json!([{"key": key, "operator": "Exists", "effect": "NoSchedule"}]);
        assert!(tolerates(Some(&ours), key));
        let everything = json!([{"operator": "Exists"}]);
        assert!(tolerates(Some(&everything), key));
        let equal = json!([{"key": key, "value": "true"}]);
        assert!(tolerates(Some(&equal), key));
        let wrong_effect = json!([{"key": key, "operator": "Exists", "effect": "NoExecute"}]);
        assert!(!tolerates(Some(&wrong_effect), key));
    }

    #[test]
    fn untainted_only_when_confirmed_or_labelled_by_gfd() {
        let mut n = NodeFacts::default();
        assert!(!ready_to_untaint(&n, true, Some(NodeState::Pending)));
        assert!(!ready_to_untaint(&n, true, Some(NodeState::Rejected)));
        assert!(ready_to_untaint(&n, true, Some(NodeState::Applied)));
        assert!(!ready_to_untaint(&n, false, None));
        n.labels.insert(LABEL_GFD_TIMESTAMP, "1800000000");
        assert!(ready_to_untaint(&n, false, None));
    }
}
