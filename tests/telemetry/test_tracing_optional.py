"""The OpenTelemetry packages are an optional extra: the gateway traces without them."""

from __future__ import annotations

import subprocess
import sys

_WITHOUT_OPENTELEMETRY = '''
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError("not installed: " + name)

sys.meta_path.insert(0, Block())
from tidegate.config import parse_config
from tidegate.gateway.app import Gateway
from tidegate.telemetry.otel_sdk import MissingTracingExtra

pools = "pools:\\n  - name: m\\n    backends:\\n      - type: upstream\\n        url: http://127.0.0.1:9/v1\\n"
assert Gateway(parse_config(pools + "tracing:\\n  enabled: true\\n")).tracing is not None
try:
    Gateway(parse_config(pools + "tracing:\\n  enabled: true\\n  exporter: sdk\\n"))
except MissingTracingExtra as error:
    print(error)
assert not [name for name in sys.modules if name.startswith("opentelemetry")]
'''


def test_builtin_exporter_needs_no_opentelemetry_package_and_sdk_names_the_extra() -> None:
    result = subprocess.run([sys.executable, "-c", _WITHOUT_OPENTELEMETRY], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "pip install 'tidegate[tracing]'" in result.stdout
