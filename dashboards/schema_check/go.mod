module freeflow/dashboards/schema_check

go 1.26

require github.com/grafana/grafana-foundation-sdk/go v0.0.22
