//! DeviceClasses -> the extended resource names they map (KEP-5004) and whether each is ours:
//! a class not ours that maps a name an extended-resource policy serves stops that policy.

use k8s_openapi::api::resource::v1::DeviceClass;
use kube::ResourceExt;

use crate::api::names::MANAGED_BY;
use crate::plan::input::DeviceClassFact;

/// A DeviceClass as the cache keeps it: name, our label, the name it maps.
pub fn strip(c: &mut DeviceClass) {
    c.metadata.managed_fields = None;
    c.metadata.annotations = None;
    let ours = is_ours(c);
    c.metadata.labels = ours.then(|| [(MANAGED_BY.0.to_string(), MANAGED_BY.1.to_string())].into());
    c.spec.config = None;
}

/// Whether the class carries our managed-by label (DeviceClasses are cluster-scoped: only
/// cluster admins write them).
pub fn is_ours(c: &DeviceClass) -> bool {
    c.labels().get(MANAGED_BY.0).map(String::as_str) == Some(MANAGED_BY.1)
}

/// The classes that map an extended resource name, and all of ours (a class of ours mapping
/// none tells that kube-apiserver dropped the field), in name order.
pub fn facts<'a>(classes: impl IntoIterator<Item = &'a DeviceClass>) -> Vec<DeviceClassFact> {
    let mut out: Vec<DeviceClassFact> = classes
        .into_iter()
        .filter(|c| is_ours(c) || c.spec.extended_resource_name.is_some())
        .map(|c| DeviceClassFact {
            name: c.name_any(),
            extended_resource_name: c.spec.extended_resource_name.clone(),
            ours: is_ours(c),
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn class(name: &str, ours: bool, ext: Option<&str>) -> DeviceClass {
        let mut v = json!({"metadata": {"name": name, "annotations": {"a": "b"},
            "labels": {"helm.sh/chart": "x"}},
            "spec": {"selectors": [{"cel": {"expression": "true"}}]}});
        if ours {
            v["metadata"]["labels"][MANAGED_BY.0] = json!(MANAGED_BY.1);
        }
        if let Some(e) = ext {
            v["spec"]["extendedResourceName"] = json!(e);
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn the_reader_reads_the_same_from_stripped_classes() {
        let all = vec![
            class("gpu.nvidia.com", false, Some("nvidia.com/gpu")),
            class("gpusharing-nvidia.com-gpu", true, Some("nvidia.com/gpu")),
            class("mig.nvidia.com", false, None),
            class("gpusharing-dropped", true, None),
        ];
        let mut stripped = all.clone();
        stripped.iter_mut().for_each(strip);
        assert_eq!(facts(&stripped), facts(&all));
        let read = facts(&all);
        // A foreign class mapping nothing is not read; ours is, mapping or not.
        let names: Vec<(&str, Option<&str>, bool)> = (read.iter())
            .map(|c| (c.name.as_str(), c.extended_resource_name.as_deref(), c.ours))
            .collect();
        assert_eq!(
            names,
            [
                ("gpu.nvidia.com", Some("nvidia.com/gpu"), false),
                ("gpusharing-dropped", None, true),
                ("gpusharing-nvidia.com-gpu", Some("nvidia.com/gpu"), true),
            ]
        );
    }
}
