"""docs/ray_two_vms.md and README.md show the two-VM recipe exactly as test_ray_two_vms.py runs it."""
from __future__ import annotations

from pathlib import Path

from two_ray_vms import RECIPE

REPO = Path(__file__).resolve().parents[2]
PAGES = (REPO / "docs" / "ray_two_vms.md", REPO / "README.md")
DOC_VALUES = dict(ray_port=6379, head_ip="VM_A_IP", model="MODEL.gguf", http_port=8000)


def test_the_page_shows_the_commands_the_test_runs():
    for page in PAGES:
        lines = [line.split("#")[0].strip() for line in page.read_text().splitlines()]
        for command in RECIPE.values():
            assert command.format(**DOC_VALUES) in lines, (page.name, command)
