//! Rules of `strategy: vgpu` and `strategy: passthrough` that do not depend on nodes: the same
//! as the CRD's CEL rules, plus the vGPU Device Manager's own (valid type names, no time-sliced
//! and MIG-backed types in one group, counts >= 1, disjoint device groups).

use std::collections::BTreeSet;

use crate::api::crd::{Backend, GpuSharingPolicySpec, Strategy};
use crate::nvidia::vgpu::parse_vgpu_type;

use super::{FieldError, err, is_label_value};

pub fn validate(spec: &GpuSharingPolicySpec, errs: &mut Vec<FieldError>) {
    if spec.strategy.is_vm() && spec.backend != Backend::DevicePlugin {
        errs.push(err(
            "spec.backend",
            "strategies vgpu and passthrough serve virtual machines through the GPU Operator's sandbox device plugin: backend must be devicePlugin",
        ));
    }
    match (spec.strategy, &spec.vgpu) {
        (Strategy::Vgpu, None) => errs.push(err("spec.vgpu", "required when strategy is vgpu")),
        (s, Some(_)) if s != Strategy::Vgpu => errs.push(err(
            "spec.vgpu",
            format!("must not be set when strategy is {}", s.as_str()),
        )),
        _ => {}
    }
    let Some(v) = &spec.vgpu else { return };
    match (&v.type_, &v.custom_layout) {
        (Some(_), Some(_)) | (None, None) => errs.push(err(
            "spec.vgpu",
            "set exactly one of type (a named entry of the vGPU Device Manager's config) and customLayout",
        )),
        (Some(t), None) if !is_label_value(t) || t.is_empty() => errs.push(err(
            "spec.vgpu.type",
            format!("{t:?} must be a valid label value (it is written to the node label nvidia.com/vgpu.config)"),
        )),
        _ => {}
    }
    let mut seen = BTreeSet::new();
    let mut all = false;
    for (i, g) in v.custom_layout.iter().flatten().enumerate() {
        let path = format!("spec.vgpu.customLayout[{i}]");
        if g.vgpu_devices.is_empty() {
            errs.push(err(
                format!("{path}.vgpuDevices"),
                "at least one vGPU type is required",
            ));
        }
        let mut mig_backed = BTreeSet::new();
        for (t, count) in &g.vgpu_devices {
            match parse_vgpu_type(t) {
                None => errs.push(err(
                    format!("{path}.vgpuDevices"),
                    format!("{t:?} is not a vGPU type name (A10-12Q, L4-6Q, A100-40C time-sliced; A100-1-5C, H200-1-18CME MIG-backed)"),
                )),
                Some(vt) => {
                    mig_backed.insert(vt.gpu_instances > 0);
                }
            }
            if !(1..=64).contains(count) {
                errs.push(err(
                    format!("{path}.vgpuDevices"),
                    format!("count of {t} must be between 1 and 64, got {count}"),
                ));
            }
        }
        if mig_backed.len() > 1 {
            errs.push(err(
                format!("{path}.vgpuDevices"),
                "cannot mix time-sliced and MIG-backed vGPU types on the same GPUs (the vGPU Device Manager refuses it)",
            ));
        }
        if let Some(crate::api::crd::GpuSelection::Invalid(v)) = &g.devices {
            errs.push(err(format!("{path}.devices"), super::invalid_devices(v)));
            continue;
        }
        match g.indices() {
            None if all || !seen.is_empty() || i > 0 => errs.push(err(
                format!("{path}.devices"),
                "a group with `devices: all` (or without devices) covers all GPUs: it must be the only group",
            )),
            None => all = true,
            Some([]) => errs.push(err(
                format!("{path}.devices"),
                "list at least one GPU index, or write `devices: all`",
            )),
            Some(d) => {
                for idx in d {
                    if !(0..=15).contains(idx) {
                        errs.push(err(
                            format!("{path}.devices"),
                            format!("GPU index {idx} is not between 0 and 15"),
                        ));
                    } else if !seen.insert(*idx) || all {
                        errs.push(err(
                            format!("{path}.devices"),
                            format!("GPU {idx} is in more than one group"),
                        ));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(text: &str) -> GpuSharingPolicySpec {
        crate::api::yaml::from_str(&format!("nodeSelector: {{}}\n{text}")).unwrap()
    }

    fn errors(text: &str) -> Vec<String> {
        let mut errs = Vec::new();
        validate(&spec(text), &mut errs);
        errs.iter().map(|e| e.to_string()).collect()
    }

    #[test]
    fn vgpu_specs() {
        assert!(errors("strategy: vgpu\nvgpu: {type: A100-1-5C}").is_empty());
        assert!(errors("strategy: passthrough").is_empty());
        assert!(errors("strategy: vgpu\nvgpu: {customLayout: [{devices: [0, 1], vgpuDevices: {L4-6Q: 4}}, {devices: [2], vgpuDevices: {L4-12Q: 2}}]}").is_empty());
        let e = errors("strategy: vgpu");
        assert!(e[0].starts_with("spec.vgpu: required"), "{e:?}");
        let e = errors("strategy: passthrough\nvgpu: {type: L4-6Q}");
        assert!(e[0].starts_with("spec.vgpu: must not be set"), "{e:?}");
        let e = errors(
            "strategy: vgpu\nvgpu: {type: L4-6Q, customLayout: [{vgpuDevices: {L4-6Q: 4}}]}",
        );
        assert!(e[0].contains("exactly one"), "{e:?}");
        let e = errors("strategy: vgpu\nvgpu: {customLayout: [{vgpuDevices: {l4-6q: 4}}]}");
        assert!(
            e[0].starts_with("spec.vgpu.customLayout[0].vgpuDevices"),
            "{e:?}"
        );
        let e = errors(
            "strategy: vgpu\nvgpu: {customLayout: [{vgpuDevices: {A100-1-5C: 2, A100-10C: 1}}]}",
        );
        assert!(e[0].contains("cannot mix"), "{e:?}");
        let e = errors(
            "strategy: vgpu\nvgpu: {customLayout: [{devices: [0], vgpuDevices: {L4-6Q: 4}}, {devices: [0], vgpuDevices: {L4-12Q: 2}}]}",
        );
        assert!(e[0].contains("GPU 0 is in more than one group"), "{e:?}");
        assert!(
            errors(
                "strategy: vgpu\nvgpu: {customLayout: [{devices: all, vgpuDevices: {L4-6Q: 4}}]}"
            )
            .is_empty()
        );
        let e = errors(
            "strategy: vgpu\nvgpu: {customLayout: [{devices: all, vgpuDevices: {L4-6Q: 4}}, {devices: [1], vgpuDevices: {L4-12Q: 2}}]}",
        );
        assert!(
            e[0].starts_with("spec.vgpu.customLayout[1].devices")
                && e[0].contains("GPU 1 is in more than one group"),
            "{e:?}"
        );
        let e = errors(
            "strategy: vgpu\nvgpu: {customLayout: [{devices: some, vgpuDevices: {L4-6Q: 4}}]}",
        );
        assert!(
            e[0].starts_with("spec.vgpu.customLayout[0].devices") && e[0].ends_with("got \"some\""),
            "{e:?}"
        );
        let e = errors(
            "strategy: vgpu\nvgpu: {customLayout: [{devices: [], vgpuDevices: {L4-6Q: 4}}]}",
        );
        assert!(
            e[0].starts_with("spec.vgpu.customLayout[0].devices"),
            "{e:?}"
        );
        let e = errors("strategy: vgpu\nvgpu: {customLayout: [{vgpuDevices: {L4-6Q: 0}}]}");
        assert!(e[0].contains("between 1 and 64"), "{e:?}");
        let e = errors("strategy: vgpu\nvgpu: {type: L4-6Q}\nbackend: dra\ndra: {namespaces: [a]}");
        assert!(e[0].starts_with("spec.backend"), "{e:?}");
    }
}
