"""A tool's JSON schema from its signature and docstring (titanax/agents/tool_schema.py):
equal to transformers' ``get_json_schema`` (the layout chat templates read) for the types a
call from JSON can carry; what the model could not be told, or a call could not build, refused
by name."""

import pytest
from transformers.utils import get_json_schema

from titanax import errors
from titanax.agents.tool_schema import json_schema
from tests.agents import tools

WHERE = "objective.tools[0]"


@pytest.mark.parametrize("tool", [tools.add, tools.pick, tools.failing])
def test_the_schema_is_transformers(tool):
    assert json_schema(tool, where=WHERE) == get_json_schema(tool)


def test_the_schema_says_what_the_docstring_and_signature_say():
    schema = json_schema(tools.pick, where=WHERE)["function"]
    assert schema["description"] == "Picks a name\nfrom a list."
    assert schema["parameters"]["required"] == ["names", "mode"]
    properties = schema["parameters"]["properties"]
    assert properties["mode"] == {"type": "string", "enum": ["first", "last"],
                                  "description": "Which end to pick from."}
    assert properties["limit"]["nullable"] and properties["limit"]["type"] == "integer"
    assert properties["key"]["type"] == ["integer", "string"]
    assert json_schema(tools.add, where=WHERE)["function"]["parameters"]["properties"]["b"][
        "description"] == "The second number, which goes on over two lines."


@pytest.mark.parametrize("tool,message", [
    (tools.undocumented, "has no docstring"),
    (tools.half_documented, "argument 'y' is not described under Args:"),
    (tools.unannotated, "argument 'x' has no type annotation"),
    (tools.varargs, r"takes \*numbers"),
    (tools.takes_a_point, "argument 'p' is annotated .*Point.* cannot build")])
def test_what_the_model_could_not_be_told_is_refused_by_name(tool, message):
    with pytest.raises(errors.AgentError, match=message) as info:
        json_schema(tool, where=WHERE)
    assert info.value.path == WHERE
