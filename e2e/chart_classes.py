#!/usr/bin/env python3
"""Prints the DeviceClasses the Helm chart installs with the DRA plugin on, as a JSON List.

Rendered by real Helm (Helm v4's library through helm-sdkpy), as .ci/check_deploy.py renders
the chart: e2e/cluster.sh applies exactly the classes a `helm install --set dra.enabled=true`
would create. Usage: chart_classes.py REPO_ROOT
"""
import json
import sys
from pathlib import Path

root = Path(sys.argv[1])
sys.path.insert(0, str(root / ".ci"))
import check_deploy  # noqa: E402  (the chart renderer of the deploy checks)

objs = check_deploy.render(root / "deploy/helm/tessera", "tessera-system",
                           {"dra": {"enabled": True}, "devicePlugin": {"enabled": False}})
classes = [o for o in objs if o.get("kind") == "DeviceClass"]
if not classes:
    sys.exit("chart_classes.py: the chart rendered no DeviceClass with dra.enabled=true")
print(json.dumps({"apiVersion": "v1", "kind": "List", "items": classes}))
