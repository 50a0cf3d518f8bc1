"""Scenario 1: the served tools, their input schemas and annotations.

Checks what MCP promises here: plugin tools are `plugin__tool` with an optional string
`transaction` property, compensators are hidden (unless --expose-compensators), the four
control tools are there, and every tool says whether it is read-only and idempotent. Prints
each tool's inputSchema and annotations so that the Rust test can compare them with the
plugins' manifests.
"""

from scenario import CONTROL_TOOLS, MODERN, check, main, open_session, parse

COMPENSATORS = ("airline__cancel", "hotel__cancel", "payment__refund")


def arguments(parser):
    parser.add_argument("--expose-compensators", action="store_true", help="expect the compensators to be listed")
    parser.add_argument("--expect-tool", action="append", default=[], help="a tool that must be listed")


async def scenario(opts):
    async with open_session(opts) as session:
        client = session.client
        tools, cursor = [], None
        while True:
            page = await client.list_tools(cursor=cursor)
            tools += page.tools
            cursor = page.next_cursor
            if not cursor:
                break
        protocol = client.protocol_version
    by_name = {tool.name: tool for tool in tools}
    check(len(by_name) == len(tools), "a tool is listed twice", tools=[t.name for t in tools])
    check((protocol == MODERN) == (opts.mode != "legacy"), "unexpected protocol version", mode=opts.mode,
          protocol=protocol)
    for name in (*CONTROL_TOOLS, "airline__book", "airline__search", "hotel__reserve", "payment__charge",
                 *opts.extra.expect_tool):
        check(name in by_name, f"{name} is not listed", tools=sorted(by_name))
    for name in COMPENSATORS:
        shown = name in by_name
        check(shown == opts.extra.expose_compensators, f"compensator {name} {'listed' if shown else 'not listed'}",
              tools=sorted(by_name))
    for tool in tools:
        annotations = tool.annotations
        check(annotations is not None and annotations.read_only_hint is not None
              and annotations.idempotent_hint is not None, f"{tool.name} lacks readOnlyHint/idempotentHint",
              annotations=annotations and annotations.model_dump(by_alias=True))
        schema = tool.input_schema
        check(schema.get("type") == "object", f"{tool.name}'s inputSchema is not an object schema", schema=schema)
        if "__" in tool.name:
            check(schema.get("properties", {}).get("transaction", {}).get("type") == "string",
                  f"{tool.name} has no string `transaction` property", schema=schema)
            check("transaction" not in schema.get("required", []), f"{tool.name} requires `transaction`", schema=schema)
    hints = {name: by_name[name].annotations for name in ("airline__search", "airline__book", "saga_status")}
    check(hints["airline__search"].read_only_hint is True, "airline__search is not read-only")
    check(hints["airline__book"].read_only_hint is False, "airline__book is read-only")
    check(hints["saga_status"].read_only_hint is True, "saga_status is not read-only")
    return {
        "protocol": protocol,
        "tools": {
            tool.name: {
                "inputSchema": tool.input_schema,
                "annotations": tool.annotations.model_dump(by_alias=True, exclude_none=True),
            }
            for tool in tools
        },
    }


if __name__ == "__main__":
    main(scenario, parse(arguments))
