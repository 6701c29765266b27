package sim

// BuiltinMigConfig is the simulator's own minimal stand-in for the GPU
// Operator's default-mig-parted-config, used when the ClusterPolicy names no
// mig-parted ConfigMap and the namespace has no default-mig-parted-config.
// Layouts for A100/H100 80GB (device IDs 0x20B2, 0x20B5, 0x2330, 0x2331) and
// H200 (0x2335, 0x233B).
const BuiltinMigConfig = `version: v1
mig-configs:
  all-disabled:
  - devices: all
    mig-enabled: false
  all-enabled:
  - devices: all
    mig-enabled: true
    mig-devices: {}
  all-1g.10gb:
  - device-filter: ["0x20B210DE", "0x20B510DE", "0x233010DE", "0x233110DE"]
    devices: all
    mig-enabled: true
    mig-devices:
      "1g.10gb": 7
  all-2g.20gb:
  - device-filter: ["0x20B210DE", "0x20B510DE", "0x233010DE", "0x233110DE"]
    devices: all
    mig-enabled: true
    mig-devices:
      "2g.20gb": 3
  all-3g.40gb:
  - device-filter: ["0x20B210DE", "0x20B510DE", "0x233010DE", "0x233110DE"]
    devices: all
    mig-enabled: true
    mig-devices:
      "3g.40gb": 2
  all-7g.80gb:
  - device-filter: ["0x20B210DE", "0x20B510DE", "0x233010DE", "0x233110DE"]
    devices: all
    mig-enabled: true
    mig-devices:
      "7g.80gb": 1
  all-1g.18gb:
  - device-filter: ["0x233510DE", "0x233B10DE"]
    devices: all
    mig-enabled: true
    mig-devices:
      "1g.18gb": 7
  all-balanced:
  - device-filter: ["0x20B210DE", "0x20B510DE", "0x233010DE", "0x233110DE"]
    devices: all
    mig-enabled: true
    mig-devices:
      "1g.10gb": 2
      "2g.20gb": 1
      "3g.40gb": 1
  - device-filter: ["0x233510DE", "0x233B10DE"]
    devices: all
    mig-enabled: true
    mig-devices:
      "1g.18gb": 2
      "2g.35gb": 1
      "3g.71gb": 1
`

// DefaultMigConfigMap is the ConfigMap the GPU Operator (before v26.3)
// points the MIG manager at when spec.migManager.config.name is empty.
const DefaultMigConfigMap = "default-mig-parted-config"
