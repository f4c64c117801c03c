"""One wide tool schema against a served model: is /health still answered meanwhile (issue 36)?

    python benchmarks/wide_schema.py [--artifact PATH] [--properties 6000] [--work DIR]

1. ``slm-align serve`` in a subprocess (the bundled model exported to ONNX unless ``--artifact`` names one).
2. A chat request whose one tool has ``--properties`` properties, each named by one CJK character (every
   name cleans to the same grammar rule base, the case the rule namer was quadratic in), sent from a
   thread while /health is polled every 10 ms: the request's status and time, /health's slowest answer.
3. The same request, and one as wide as the bounds allow (``MAX_SCHEMA_PROPERTIES``), checked in this
   process as a GGUF server checks it (``tool_choice`` "required": the grammar is built too).

Not part of the test run; run it on the code before and after a change and compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def wide_request(properties: int) -> dict:
    """A chat request with one tool of ``properties`` single-character (CJK) properties."""
    names = {chr(0x4E00 + i): {"type": "string"} for i in range(properties)}
    tool = {"type": "function", "function": {"name": "wide", "description": "A wide form.",
                                             "parameters": {"type": "object", "properties": names}}}
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "tools": [tool], "max_tokens": 4}


def bundled_onnx(work: Path) -> Path:
    """The bundled model exported to ONNX fp32 (as the server tests serve it)."""
    from slm_align.export.publishing.stage import ExportRequest, run_export
    from slm_align.modeling.models import DEFAULT_MODEL_DIR

    request = ExportRequest(str(DEFAULT_MODEL_DIR), "onnx", "fp32", out=work / "artifact", verify=False)
    return run_export(request).stage_dir


def start_server(artifact: Path) -> tuple[subprocess.Popen, str]:
    """``slm-align serve`` on a free port; its process and URL once it listens."""
    import slm_align

    code = Path(slm_align.__file__).resolve().parents[1]  # the server runs the code this process imported
    process = subprocess.Popen([sys.executable, "-m", "slm_align", "serve", str(artifact), "--port", "0", "--json"],
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(code)})
    text = ""
    while True:  # the announcement is one JSON object over several lines
        line = process.stdout.readline()
        if not line:
            process.kill()
            raise SystemExit("the server exited before it listened")
        text += line
        try:
            return process, json.loads(text)["url"].rstrip("/")
        except json.JSONDecodeError:
            continue


def during_request(url: str, body: dict) -> dict:
    """Post ``body`` from a thread and poll /health until it is answered: status, seconds, worst /health."""
    result: dict = {}
    content = json.dumps(body).encode()  # encoded before: this process's own work would delay its polls
    for _ in range(5):  # a warm server and client first
        httpx.get(f"{url}/health", timeout=600)

    def post():
        started = time.perf_counter()
        response = httpx.post(f"{url}/v1/chat/completions", content=content, timeout=600,
                              headers={"Content-Type": "application/json"})
        result.update(status=response.status_code, request_s=time.perf_counter() - started,
                      error=response.json().get("error", {}).get("message", "")[:100])

    sender = threading.Thread(target=post)
    sender.start()
    polls = []
    with httpx.Client(timeout=600) as client:
        while sender.is_alive():
            started = time.perf_counter()
            assert client.get(f"{url}/health").status_code == 200
            polls.append(time.perf_counter() - started)
            time.sleep(0.01)
    sender.join()
    return {**result, "request_s": round(result["request_s"], 3), "health_polls": len(polls),
            "worst_health_s": round(max(polls), 3), "median_health_s": round(sorted(polls)[len(polls) // 2], 3)}


def checked_as_gguf(body: dict) -> dict:
    """Seconds to check ``body`` as a GGUF server does with ``tool_choice`` "required" (grammar included)."""
    from slm_align.ondevice.agent.server.body import Limits
    from slm_align.ondevice.agent.server.chat_request import parse_chat
    from slm_align.ondevice.agent.server.errors import ApiError

    started = time.perf_counter()
    try:
        parse_chat({**body, "tool_choice": "required"}, Limits(), "gguf")
        outcome = "accepted"
    except ApiError as exc:
        outcome = f"{exc.status}: {str(exc)[:100]}"
    return {"check_s": round(time.perf_counter() - started, 3), "outcome": outcome}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, help="a .gguf file or ONNX export (default: the bundled model)")
    parser.add_argument("--properties", type=int, default=6000)
    parser.add_argument("--work", type=Path, help="where to export the bundled model (default: a temporary folder)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="wide-schema-"))
    artifact = args.artifact or bundled_onnx(work)
    body = wide_request(args.properties)
    print(json.dumps({"properties": args.properties, "body_kib": round(len(json.dumps(body)) / 1024, 1)}))
    process, url = start_server(artifact)
    try:
        print(json.dumps({"served": "wide", **during_request(url, body)}))
    finally:
        process.terminate()
        process.wait()
    try:
        from slm_align.ondevice.agent.server.body import MAX_SCHEMA_PROPERTIES
    except ImportError:  # the code before the bound
        MAX_SCHEMA_PROPERTIES = None
    print(json.dumps({"checked_as_gguf": "wide", **checked_as_gguf(body)}))
    if MAX_SCHEMA_PROPERTIES:
        print(json.dumps({"checked_as_gguf": f"{MAX_SCHEMA_PROPERTIES} properties",
                          **checked_as_gguf(wide_request(MAX_SCHEMA_PROPERTIES))}))


if __name__ == "__main__":
    main()
