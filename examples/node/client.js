#!/usr/bin/env node
// Streams one chat completion from a specdec server with @grpc/grpc-js: reads the server's info, then
// streams Generate, writing the text as it arrives. Usage: node client.js [options] "your prompt".
"use strict";

const fs = require("node:fs");
const path = require("node:path");
const { parseArgs } = require("node:util");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.join(__dirname, "..", "..", "protos");
const USAGE = `usage: node client.js [options] PROMPT

  --address HOST:PORT   the scheduler's client API (default 127.0.0.1:50051)
  --max-tokens N        most tokens to generate (default 64)
  --temperature T       0 = greedy (default: the server's, 1.0)
  --seed N              per-request sampling seed
  --api-key KEY         sent as "authorization: Bearer KEY" (default: $SPECDEC_API_KEY)
  --ca-file PATH        TLS, trusting this CA certificate (default: plaintext)
  --json                print one JSON line (info, text, token ids, finish reason, usage) instead
  -h, --help            this text`;

/** The command line as {address, maxTokens, temperature, seed, apiKey, caFile, json, prompt}; exit 2 if bad. */
function parseCommandLine(argv) {
  let parsed;
  try {
    parsed = parseArgs({
      args: argv,
      allowPositionals: true,
      options: {
        address: { type: "string", default: "127.0.0.1:50051" },
        "max-tokens": { type: "string", default: "64" },
        temperature: { type: "string" },
        seed: { type: "string" },
        "api-key": { type: "string", default: process.env.SPECDEC_API_KEY || "" },
        "ca-file": { type: "string" },
        json: { type: "boolean", default: false },
        help: { type: "boolean", short: "h", default: false },
      },
    });
  } catch (error) {  // an unknown option, or an option without its value
    console.error(`error: ${error.message}\n${USAGE}`);
    process.exit(2);
  }
  const { values, positionals } = parsed;
  if (values.help || positionals.length !== 1) {
    console.error(USAGE);
    process.exit(values.help ? 0 : 2);
  }
  return {
    address: values.address,
    maxTokens: toNumber("--max-tokens", values["max-tokens"]),
    temperature: values.temperature === undefined ? undefined : toNumber("--temperature", values.temperature),
    seed: values.seed === undefined ? undefined : toNumber("--seed", values.seed),
    apiKey: values["api-key"],
    caFile: values["ca-file"],
    json: values.json,
    prompt: positionals[0],
  };
}

function toNumber(flag, text) {
  const value = Number(text);
  if (text.trim() === "" || !Number.isFinite(value)) {
    console.error(`error: ${flag} must be a number, got ${JSON.stringify(text)}`);
    process.exit(2);
  }
  return value;
}

/** A GenerationService client: plaintext, or TLS trusting --ca-file. */
function makeClient(options) {
  const definition = protoLoader.loadSync("specdec/v1/generation.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as in the .proto: max_tokens, token_ids
    longs: Number,
    enums: String, // finish_reason: "FINISH_REASON_LENGTH"
    defaults: true,
    oneofs: true,
  });
  const { GenerationService } = grpc.loadPackageDefinition(definition).specdec.v1;
  const credentials = options.caFile
    ? grpc.credentials.createSsl(fs.readFileSync(options.caFile))
    : grpc.credentials.createInsecure();
  return new GenerationService(options.address, credentials);
}

function callMetadata(apiKey) {
  const metadata = new grpc.Metadata();
  if (apiKey) metadata.set("authorization", `Bearer ${apiKey}`);
  return metadata;
}

function getServerInfo(client, metadata) {
  return new Promise((resolve, reject) => {
    client.GetServerInfo({}, metadata, (error, info) => (error ? reject(error) : resolve(info)));
  });
}

/** Streams Generate; onDelta(response) for every message. Resolves with the last message. */
function generate(client, metadata, options, onDelta) {
  const sampling = { max_tokens: options.maxTokens };
  // temperature and seed are proto3 `optional`: left out here, the server's defaults apply.
  if (options.temperature !== undefined) sampling.temperature = options.temperature;
  if (options.seed !== undefined) sampling.seed = options.seed;
  const request = { messages: [{ role: "user", content: options.prompt }], sampling };
  return new Promise((resolve, reject) => {
    let last = null;
    const call = client.Generate(request, metadata);
    call.on("data", (response) => {
      last = response;
      onDelta(response);
    });
    call.on("error", reject);
    call.on("end", () => (last ? resolve(last) : reject(new Error("the stream ended with no message"))));
  });
}

async function main() {
  const options = parseCommandLine(process.argv.slice(2));
  const client = makeClient(options);
  const metadata = callMetadata(options.apiKey);
  const info = await getServerInfo(client, metadata);
  const { counters } = info;
  const result = { model: info.model, num_requests: counters.num_requests, text: "", token_ids: [] };
  if (!options.json) {
    console.error(`model ${info.model} (proposer ${info.proposer}, k=${info.num_speculative_tokens}); ` +
      `requests so far ${counters.num_requests}, acceptance rate ${counters.acceptance_rate.toFixed(3)}`);
  }
  let numMessages = 0;
  const last = await generate(client, metadata, options, (response) => {
    numMessages += 1;
    result.text += response.text;
    result.token_ids.push(...response.token_ids);
    if (!options.json) process.stdout.write(response.text);
  });
  Object.assign(result, { num_messages: numMessages, finish_reason: last.finish_reason, usage: last.usage });
  if (options.json) {
    console.log(JSON.stringify(result));
  } else {
    const usage = last.usage;
    process.stdout.write("\n");
    console.error(`finish reason ${last.finish_reason}; prompt ${usage.prompt_tokens} tokens, completion ` +
      `${usage.completion_tokens}, drafted ${usage.draft_tokens}, accepted ${usage.accepted_tokens}`);
  }
  client.close();
}

main().catch((error) => {
  // A gRPC error carries a numeric status code; grpc.status maps names to codes.
  const name = Object.keys(grpc.status).find((key) => grpc.status[key] === error.code);
  console.error(name ? `error: ${name}: ${error.details}` : `error: ${error.message}`);
  process.exit(1);
});
