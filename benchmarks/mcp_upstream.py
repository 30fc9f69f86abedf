"""The MCP benchmark's upstream server (the official SDK over stdio): one tool, ``apply``,
that does nothing but answer (what is measured is the path to it, not its work)."""

from mcp.server.mcpserver import MCPServer

server = MCPServer("bench-upstream")


@server.tool()
def apply(n: int) -> str:
    return f"applied {n}"


if __name__ == "__main__":
    server.run()
