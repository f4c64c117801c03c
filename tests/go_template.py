"""Render an Ollama ``TEMPLATE`` with Go's own ``text/template``, the engine Ollama executes it with.

A small Go program (standard library only) is built once per test session with the ``go`` toolchain
(Debian's ``golang-go``, installed by the README's set-up step); each call passes the template and the
messages as JSON on stdin. The data is what Ollama gives a chat template: ``.Messages``, each with
``.Role`` and ``.Content``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

PROGRAM = """package main

import (
	"encoding/json"
	"os"
	"text/template"
)

type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type Input struct {
	Template string    `json:"template"`
	Messages []Message `json:"messages"`
}

func main() {
	var in Input
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		panic(err)
	}
	parsed := template.Must(template.New("modelfile").Parse(in.Template))
	if err := parsed.Execute(os.Stdout, map[string]any{"Messages": in.Messages}); err != nil {
		panic(err)
	}
}
"""


def build_renderer(folder: Path) -> Path:
    """Compile the renderer into ``folder``; its path. Go's build cache goes there too."""
    go = shutil.which("go")
    if go is None:
        raise FileNotFoundError("no go toolchain: apt-get install golang-go (the README's set-up step does)")
    source = folder / "render.go"
    source.write_text(PROGRAM, encoding="utf-8")
    binary = folder / "render"
    env = {"PATH": str(Path(go).parent), "HOME": str(folder), "GOCACHE": str(folder / "cache"),
           "GO111MODULE": "off", "GOFLAGS": "", "CGO_ENABLED": "0"}
    subprocess.run([go, "build", "-o", str(binary), str(source)], check=True, env=env, timeout=300,
                   capture_output=True)
    return binary


def render_go(renderer: Path, template: str, messages: list[dict]) -> str:
    """``template`` executed by Go's text/template over ``messages``."""
    payload = json.dumps({"template": template, "messages": messages})
    done = subprocess.run([str(renderer)], input=payload, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout
