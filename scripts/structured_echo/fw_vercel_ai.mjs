// The Vercel AI SDK (npm `ai` + `@ai-sdk/openai`), run with node by scripts/measure_structured_echo.py.
// Same arguments and RESULT line as the Python children (_child.py), plus --node-dir: a folder whose
// node_modules holds the packages (they are not installed into the repository).
// Modes: "Output.object/chat", "Output.object/responses" -- generateText with output: Output.object,
// echo: the SDK's own result.response.messages -- and "generateObject/chat" -- generateObject, whose
// result holds no messages, echo: the object as JSON.stringify writes it, the way its users echo it.
import { createRequire } from "node:module";
import { join } from "node:path";

const ASK = "Describe a famous scientist.";
const MORE = "Another one.";
const PERSON_SCHEMA = {
  type: "object",
  properties: { name: { type: "string" }, age: { type: "integer" }, city: { type: "string" } },
  required: ["name", "age", "city"], additionalProperties: false,
};

function parseArgs(argv) {
  const out = { maxTokens: 60 };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, "").replace(/-([a-z])/g, (_, c) => c.toUpperCase());
    out[key] = argv[i + 1];
  }
  out.maxTokens = Number(out.maxTokens);
  return out;
}

function emit(result) {
  process.stdout.write("RESULT " + JSON.stringify(result) + "\n");
}

async function lastRequestId(args) {
  const headers = args.mlxKey ? { Authorization: `Bearer ${args.mlxKey}` } : {};
  const resp = await fetch(args.mlxUrl.replace(/\/$/, "") + "/v1/cache/stats", { headers });
  const recent = (await resp.json()).recent || [];
  return recent.length ? recent[recent.length - 1].request_id : null;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const [call, api] = args.mode.split("/");
  const out = { framework: "vercel ai-sdk", api, mode: args.mode, marks: [] };
  let ai, provider;
  try {
    const req = createRequire(join(args.nodeDir, "package.json"));
    ai = req("ai");
    provider = req("@ai-sdk/openai");
    const version = (name) => req(join(args.nodeDir, "node_modules", name, "package.json")).version;
    out.version = `ai ${version("ai")} / @ai-sdk/openai ${version("@ai-sdk/openai")}`;
  } catch (err) {
    emit({ ...out, version: "", skipped: `not importable: ${err.message}` });
    return;
  }
  try {
    const openai = provider.createOpenAI({ baseURL: args.baseUrl + "/v1", apiKey: args.key });
    const model = api === "chat" ? openai.chat(args.model) : openai.responses(args.model);
    const schema = ai.jsonSchema(PERSON_SCHEMA);
    const common = { model, system: args.system, maxOutputTokens: args.maxTokens, temperature: 0, maxRetries: 0 };
    const providerOptions = api === "responses" ? { openai: { store: false } } : undefined;
    let messages = [{ role: "user", content: ASK }];
    const replies = [];
    out.marks.push(await lastRequestId(args));
    for (let turn = 1; turn <= 2; turn++) {
      if (call === "generateObject") {
        const r = await ai.generateObject({ ...common, messages, schema, schemaName: "person", providerOptions });
        out.marks.push(await lastRequestId(args));
        replies.push(r.object);
        messages = [...messages, { role: "assistant", content: JSON.stringify(r.object) }, { role: "user", content: MORE }];
        out.echo = "assistant content = JSON.stringify(result.object)";
      } else if (call === "Output.object") {
        const r = await ai.generateText({ ...common, messages, providerOptions,
                                           output: ai.Output.object({ schema, name: "person" }) });
        out.marks.push(await lastRequestId(args));
        replies.push(r.output);
        messages = [...messages, ...r.response.messages, { role: "user", content: MORE }];
        out.echo = "result.response.messages + user";
      } else {
        throw new Error(`unknown mode ${args.mode}`);
      }
    }
    out.replies = replies;
  } catch (err) {
    out.error = `${err.name}: ${err.message}`;
    out.traceback = String(err.stack || "").slice(-2000);
  }
  emit(out);
}

main();
