// A plain JMS consumer of one amqstream stream, with nothing of ours but the header names
// (docs/protocol.md): take an offer, read its data queue, place each chunk by the standard
// message-group headers (JMSXGroupID = the stream, JMSXGroupSeq = the chunk's number),
// stop at the end marker, check the SHA-256. An inline offer carries the file itself. Used by tests/system/test_network.py; docs/java.md
// walks through it.
//
// usage: java StreamConsumer BROKER_URL USER PASSWORD QUEUE OUT_FILE
import java.io.RandomAccessFile;
import java.security.MessageDigest;
import java.util.HexFormat;
import javax.jms.BytesMessage;
import javax.jms.Connection;
import javax.jms.Message;
import javax.jms.MessageConsumer;
import javax.jms.Session;
import org.apache.activemq.ActiveMQConnectionFactory;

public class StreamConsumer {
    public static void main(String[] args) {
        try {
            consume(args);
        } catch (Exception e) {
            // The client's transport threads would keep the JVM alive after a refused login.
            e.printStackTrace();
            System.exit(1);
        }
        System.exit(0);
    }

    /** A user name as one element of a data queue's name (protocol.md, "Destinations"). */
    static String ownerElement(String user) {
        if (user.isEmpty()) return "_";
        StringBuilder out = new StringBuilder();
        for (byte b : user.getBytes(java.nio.charset.StandardCharsets.UTF_8)) {
            char c = (char) (b & 0xff);
            boolean plain = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-';
            out.append(plain ? String.valueOf(c) : String.format("_%02x", b & 0xff));
        }
        if (out.length() <= 64) return out.toString();
        try {
            byte[] digest = java.security.MessageDigest.getInstance("SHA-256")
                    .digest(user.getBytes(java.nio.charset.StandardCharsets.UTF_8));
            StringBuilder hex = new StringBuilder("_h");
            for (int i = 0; i < 20; i++) hex.append(String.format("%02x", digest[i] & 0xff));
            return hex.toString();
        } catch (java.security.NoSuchAlgorithmException e) {
            throw new IllegalStateException(e);
        }
    }

    static void consume(String[] args) throws Exception {
        String url = args[0], user = args[1], password = args[2], queue = args[3], out = args[4];
        Connection connection = new ActiveMQConnectionFactory(user, password, url).createConnection();
        connection.start();
        try {
            Session session = connection.createSession(false, Session.CLIENT_ACKNOWLEDGE);
            MessageConsumer offers = session.createConsumer(session.createQueue(queue), "amqs_kind = 'offer'");
            Message offer = offers.receive(60_000);
            if (offer == null) throw new IllegalStateException("no stream offered on " + queue + " in 60s");
            String streamId = offer.getStringProperty("amqs_stream");
            String dataQueue = offer.getStringProperty("amqs_data_dest").replaceFirst("^/queue/", "");
            // The queue the broker's stamp implies, never one the offer chooses (protocol.md, "Destinations").
            String stamp = offer.getStringProperty("JMSXUserID");
            if (stamp != null && !dataQueue.equals(queue + ".amqs." + ownerElement(stamp) + "." + streamId)) {
                throw new IllegalStateException("stream " + streamId + ": data queue " + dataQueue
                        + " is not its sender's (" + stamp + ")");
            }
            long size = Long.parseLong(offer.getStringProperty("amqs_size"));
            long chunkSize = Long.parseLong(offer.getStringProperty("amqs_chunk_size"));
            String sha = null;
            try (RandomAccessFile file = new RandomAccessFile(out, "rw")) {
                file.setLength(size);
                // An inline offer (a small file of a many-file send) is the whole file.
                boolean inline = "1".equals(offer.getStringProperty("amqs_inline"));
                if (inline) {
                    if (offer.getStringProperty("amqs_encoding") != null) {
                        throw new IllegalStateException("stream " + streamId + ": compressed; this consumer does not decode zstd");
                    }
                    BytesMessage whole = (BytesMessage) offer;
                    byte[] body = new byte[(int) whole.getBodyLength()];
                    whole.readBytes(body);
                    file.write(body);
                }
                MessageConsumer data = inline ? null : session.createConsumer(session.createQueue(dataQueue));
                while (data != null) {
                    Message m = data.receive(60_000);
                    if (m == null) throw new IllegalStateException("stream " + streamId + ": no chunk in 60s");
                    String kind = m.getStringProperty("amqs_kind");
                    if ("end".equals(kind)) {
                        sha = m.getStringProperty("amqs_sha256");
                        m.acknowledge();
                        break;
                    }
                    if (!"data".equals(kind)) continue;
                    if (!streamId.equals(m.getStringProperty("JMSXGroupID"))) {
                        throw new IllegalStateException("stream " + streamId + ": a chunk of group "
                                + m.getStringProperty("JMSXGroupID") + " on its data queue");
                    }
                    long position = (m.getIntProperty("JMSXGroupSeq") - 1L) * chunkSize;
                    // amqs_offset says the same in bytes; a disagreement means a broken sender.
                    if (position != Long.parseLong(m.getStringProperty("amqs_offset"))) {
                        throw new IllegalStateException("stream " + streamId + ": JMSXGroupSeq and amqs_offset disagree");
                    }
                    BytesMessage chunk = (BytesMessage) m;
                    byte[] body = new byte[(int) chunk.getBodyLength()];
                    chunk.readBytes(body);
                    file.seek(position);
                    file.write(body);
                }
            }
            if (sha == null) sha = offer.getStringProperty("amqs_sha256");
            MessageDigest digest = MessageDigest.getInstance("SHA-256");
            try (var in = new java.io.FileInputStream(out)) {
                byte[] buf = new byte[1 << 20];
                for (int n; (n = in.read(buf)) > 0; ) digest.update(buf, 0, n);
            }
            String got = HexFormat.of().formatHex(digest.digest());
            if (sha != null && !sha.equals(got)) {
                throw new IllegalStateException("stream " + streamId + ": sha256 " + got + ", sender said " + sha);
            }
            offer.acknowledge();  // CLIENT_ACKNOWLEDGE: every message of the session so far
            System.out.println(streamId + " " + size + " " + got);
        } finally {
            connection.close();
        }
    }
}
