// A Sparkplug B edge node for the host tests: Eclipse Tahu's JavaScript client
// (sparkplug-client 3.2.4, its payload codec sparkplug-payload), driven line by line.
//
// stdin, one JSON object a line:
//   {"op": "nbirth", "metrics": [...]}            publishNodeBirth (the client adds seq, bdSeq)
//   {"op": "dbirth", "device": "d", "metrics": [...]}
//   {"op": "ndata", "metrics": [...]}  {"op": "ddata", "device": "d", "metrics": [...]}
//   {"op": "ddeath", "device": "d"}
//   {"op": "skip", "count": n}                    lose n seqs (a gap on the wire)
//   {"op": "stop"}                                a clean stop (NDEATH first: publishDeath)
//   {"op": "echo", "on": true}                    apply each DCMD and report the written
//                                                 metrics back in a DDATA (as a device would)
// Metrics as sparkplug-payload takes them: {"name", "alias", "type", "value", "timestamp"}.
// stdout, one JSON object a line: {"event": "connected"}, {"event": "published", "op": ...},
// {"event": "ncmd", "metrics": [...]}, {"event": "dcmd", "device": "d", "metrics": [...]},
// {"event": "rebirth"} (births published again after an NCMD Node Control/Rebirth).
//
// argv: serverUrl group node clientId [qos1]
// qos1: the client's publishes go at QoS 1. Sparkplug sends data at QoS 0, which the broker
// forgets once sent: a host killed mid-stream cannot get it back (docs/sparkplug.md); at QoS 1
// the broker keeps it for the host's persistent session, and the test shows none is lost.
"use strict";

const readline = require("readline");
const sparkplug = require("sparkplug-client");

const [serverUrl, groupId, edgeNode, clientId, qos] = process.argv.slice(2);
const client = sparkplug.newClient({
  serverUrl,
  username: "",
  password: "",
  groupId,
  edgeNode,
  clientId,
  publishDeath: true,
});

if (qos === "qos1") {
  const mqttClient = client.client;
  const publish = mqttClient.publish.bind(mqttClient);
  mqttClient.publish = (topic, message, options, callback) =>
    publish(topic, message, Object.assign({}, options || {}, { qos: 1 }), callback);
}

const births = { node: null, devices: new Map() };
let echo = false;

function emit(event) {
  process.stdout.write(JSON.stringify(event) + "\n");
}

function stamp(metrics) {
  const now = Date.now();
  return metrics.map((m) => Object.assign({ timestamp: now }, m));
}

function payload(metrics) {
  return { timestamp: Date.now(), metrics: stamp(metrics || []) };
}

function plain(metrics) {
  return (metrics || []).map((m) => ({
    name: m.name,
    alias: m.alias === undefined ? undefined : Number(m.alias),
    type: m.type,
    value: typeof m.value === "object" && m.value !== null ? Number(m.value) : m.value,
  }));
}

function rebirth() {
  if (births.node !== null) {
    client.publishNodeBirth(payload(births.node));
  }
  for (const [device, metrics] of births.devices) {
    client.publishDeviceBirth(device, payload(metrics));
  }
  emit({ event: "rebirth" });
}

client.on("birth", () => emit({ event: "connected" }));
client.on("ncmd", (message) => {
  const metrics = plain(message.metrics);
  emit({ event: "ncmd", metrics });
  if (metrics.some((m) => m.name === "Node Control/Rebirth" && m.value === true)) {
    rebirth();
  }
});
client.on("dcmd", (device, message) => {
  const metrics = plain(message.metrics);
  emit({ event: "dcmd", device, metrics });
  if (echo) {
    const types = new Map((births.devices.get(device) || []).map((m) => [m.name, m.type]));
    const written = metrics.map((m) => ({ name: m.name, type: types.get(m.name) || m.type, value: m.value }));
    client.publishDeviceData(device, payload(written));
    emit({ event: "echoed", device });
  }
});
client.on("error", (error) => emit({ event: "error", message: String(error) }));

const input = readline.createInterface({ input: process.stdin });
input.on("line", (line) => {
  if (!line.trim()) {
    return;
  }
  const command = JSON.parse(line);
  switch (command.op) {
    case "nbirth":
      births.node = command.metrics;
      births.devices.clear();
      client.publishNodeBirth(payload(command.metrics));
      break;
    case "dbirth":
      births.devices.set(command.device, command.metrics);
      client.publishDeviceBirth(command.device, payload(command.metrics));
      break;
    case "ndata":
      client.publishNodeData(payload(command.metrics));
      break;
    case "ddata":
      client.publishDeviceData(command.device, payload(command.metrics));
      break;
    case "ddeath":
      births.devices.delete(command.device);
      client.publishDeviceDeath(command.device, payload([]));
      break;
    case "skip":
      // The client keeps its seq in a field TypeScript calls private: lose some on purpose.
      for (let i = 0; i < (command.count || 1); i++) {
        client.incrementSeqNum();
      }
      break;
    case "echo":
      echo = Boolean(command.on);
      break;
    case "stop":
      client.stop();
      break;
    default:
      emit({ event: "error", message: `unknown op ${command.op}` });
      return;
  }
  emit({ event: "published", op: command.op });
});
input.on("close", () => process.exit(0));
