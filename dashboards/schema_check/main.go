// Checks a Grafana dashboard JSON against the schema types of Grafana's foundation SDK
// (Apache-2.0): strict decoding (unknown or mistyped fields are errors), then the SDK's
// validation. Grafana itself cannot run here (AGPL, not packaged); scripts/test runs this:
//
//	cd dashboards/schema_check && go run . ../freeflow.json
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/cog/plugins"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
)

// The SDK returns its error list typed as an error even when it is empty.
func failure(err error) error {
	if errs, ok := err.(cog.BuildErrors); ok && len(errs) == 0 {
		return nil
	}
	return err
}

func main() {
	plugins.RegisterDefaultPlugins()
	raw, err := os.ReadFile(os.Args[1])
	if err != nil {
		fmt.Println(err)
		os.Exit(2)
	}
	// "__inputs" belongs to Grafana's export format, around the dashboard model.
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	delete(fields, "__inputs")
	model, _ := json.Marshal(fields)
	var board dashboard.Dashboard
	if err := failure(board.UnmarshalJSONStrict(model)); err != nil {
		fmt.Println("strict decoding:", err)
		os.Exit(1)
	}
	if err := failure(board.Validate()); err != nil {
		fmt.Println("validation:", err)
		os.Exit(1)
	}
	fmt.Printf("%d panels, %d variables: valid\n", len(board.Panels), len(board.Templating.List))
}
