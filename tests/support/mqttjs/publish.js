// A device written by nobody here: MQTT.js publishes every line of a JSON-lines file
// ({"topic": ..., "payload": ...}) at QoS 1 over MQTT 3.1.1, at most `window` unacknowledged,
// then prints "published N" and exits 0. Usage: node publish.js PORT FILE [WINDOW] [CLIENT_ID]
"use strict";
const fs = require("fs");
const mqtt = require("mqtt");

const [port, file, windowArg, clientId] = process.argv.slice(2);
const window = Number(windowArg || 100);
const lines = fs.readFileSync(file, "utf8").split("\n").filter((l) => l.length > 0);
const messages = lines.map((l) => JSON.parse(l));

const client = mqtt.connect({
  host: "127.0.0.1",
  port: Number(port),
  protocolVersion: 4,
  clientId: clientId || `mqttjs-${process.pid}`,
  clean: true,
  reconnectPeriod: 0,
});
client.on("error", (err) => {
  console.error(`error: ${err.message}`);
  process.exit(1);
});
client.on("close", () => {
  if (acked < messages.length) {
    console.error(`closed after ${acked} of ${messages.length}`);
    process.exit(1);
  }
});

let next = 0;
let acked = 0;
function pump() {
  while (next < messages.length && next - acked < window) {
    const { topic, payload } = messages[next++];
    client.publish(topic, payload, { qos: 1 }, (err) => {
      if (err) {
        console.error(`publish failed: ${err.message}`);
        process.exit(1);
      }
      acked += 1;
      if (acked === messages.length) {
        console.log(`published ${acked}`);
        client.end(false, {}, () => process.exit(0));
      } else {
        pump();
      }
    });
  }
}
client.on("connect", pump);
