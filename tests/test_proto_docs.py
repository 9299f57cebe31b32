"""Every RPC and every field of the gRPC contract is named in docs/ (docs/proto.md is the reference).

The contract is read from the generated descriptors of `kvcache_proto` (scripts/gen_proto.py), so a
field added to proto/kvcache/v1/kvcache.proto and regenerated fails here until a doc names it as
`Message.field` (an RPC as `KVCache.Method`): a client in another language is written from the docs,
and a field described only in a proto comment is one it cannot implement. docs/proto.md's tables must
also agree with the proto (no field it names is missing, and each row's number is the field's).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from kvcache_proto import kvcache_pb2

DOCS = Path(__file__).resolve().parents[1] / "docs"
PROTO_MD = DOCS / "proto.md"
HOW_TO = (
    "add a row `| `Message.field` | number | type | meaning |` to the message's table in docs/proto.md "
    "(an RPC: a row `KVCache.Method` in its service table); see docs/proto.md, 'Adding a field'"
)


def messages(descriptors: list[Descriptor] | None = None, prefix: str = "") -> Iterator[tuple[str, Descriptor]]:
    """Every message, nested ones included, by its name within the package ("KVEvent", "Outer.Inner")."""
    for message in descriptors if descriptors is not None else kvcache_pb2.DESCRIPTOR.message_types_by_name.values():
        name = prefix + message.name
        yield name, message
        yield from messages(list(message.nested_types), name + ".")


def fields() -> Iterator[tuple[str, FieldDescriptor]]:
    for name, message in messages():
        for field in message.fields:
            yield f"{name}.{field.name}", field


def rpcs() -> Iterator[str]:
    for service in kvcache_pb2.DESCRIPTOR.services_by_name.values():
        for method in service.methods:
            yield f"{service.name}.{method.name}"


def docs_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md")))


def named(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text) is not None


@pytest.mark.timeout(30)
def test_the_descriptors_hold_the_contract() -> None:
    """A sanity check of the walk: the service and a few fields every client uses."""
    assert "KVCache.Lookup" in set(rpcs())
    names = {name for name, _ in fields()}
    assert {"LookupRequest.namespace", "Block.data", "InfoResponse.shm_dir", "KVEvent.sequence"} <= names


@pytest.mark.timeout(30)
def test_every_rpc_is_named_in_the_docs() -> None:
    text = docs_text()
    missing = [name for name in rpcs() if not named(text, name)]
    assert not missing, f"RPCs no doc names: {missing}; {HOW_TO}"


@pytest.mark.timeout(30)
def test_every_field_is_named_in_the_docs() -> None:
    text = docs_text()
    missing = [name for name, _ in fields() if not named(text, name)]
    assert not missing, f"proto fields no doc names: {missing}; {HOW_TO}"


@pytest.mark.timeout(30)
def test_every_message_has_a_section_in_proto_md() -> None:
    text = PROTO_MD.read_text(encoding="utf-8")
    headings = set(re.findall(r"^### (\S+)$", text, flags=re.M))
    missing = [name for name, _ in messages() if name not in headings]
    assert not missing, f"messages without a '### Name' section in docs/proto.md: {missing}"


@pytest.mark.timeout(30)
def test_proto_md_rows_match_the_proto() -> None:
    """Each table row `| `Message.field` | number | ...` names a real field, with its number, once."""
    text = PROTO_MD.read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([\w.]+)` \| (\d+) \|", text, flags=re.M)
    known = dict(fields())
    assert rows, "docs/proto.md has no field rows"
    seen: set[str] = set()
    for name, number in rows:
        assert name in known, f"docs/proto.md documents {name}, which the proto does not have"
        assert int(number) == known[name].number, (
            f"docs/proto.md gives {name} number {number}, the proto {known[name].number}"
        )
        assert name not in seen, f"docs/proto.md documents {name} twice"
        seen.add(name)
    undocumented = sorted(set(known) - seen)
    assert not undocumented, f"fields without a row in docs/proto.md: {undocumented}; {HOW_TO}"


@pytest.mark.timeout(30)
def test_proto_md_names_no_field_or_rpc_that_does_not_exist() -> None:
    text = PROTO_MD.read_text(encoding="utf-8")
    message_names = {name for name, _ in messages()}
    services = set(kvcache_pb2.DESCRIPTOR.services_by_name)
    valid = {name for name, _ in fields()} | set(rpcs())
    valid |= {f"{name}.{enum.name}" for name, message in messages() for enum in message.enum_types}
    stale = set()
    for ref in re.findall(r"`([A-Z]\w*(?:\.\w+)+)`", text):
        owner = ref.rsplit(".", 1)[0]
        if (owner in message_names or owner in services) and ref not in valid:
            stale.add(ref)
    assert not stale, f"docs/proto.md names what the proto does not have: {sorted(stale)}"
