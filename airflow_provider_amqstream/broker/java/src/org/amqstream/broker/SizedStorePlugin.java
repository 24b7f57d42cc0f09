package org.amqstream.broker;

import java.io.DataInput;
import java.io.DataOutput;
import java.io.IOException;
import java.lang.reflect.Field;

import org.apache.activemq.broker.Broker;
import org.apache.activemq.broker.BrokerPlugin;
import org.apache.activemq.command.Message;
import org.apache.activemq.openwire.OpenWireFormat;
import org.apache.activemq.store.PersistenceAdapter;
import org.apache.activemq.store.kahadb.KahaDBPersistenceAdapter;
import org.apache.activemq.store.kahadb.KahaDBStore;
import org.apache.activemq.util.ByteSequence;
import org.apache.activemq.util.DataByteArrayOutputStream;
import org.apache.activemq.wireformat.WireFormat;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Gives KahaDB an OpenWire format that marshals a large message into a buffer sized once.
 *
 * <p>KahaDB marshals every message it stores with OpenWire's loose encoding into a buffer
 * that starts at 2 KiB: the body fills it to exactly its size, and the very next field makes
 * it double, so a 1 MiB body costs a 1 MiB array, a 2 MiB array and two copies. Here a
 * message with a body of 64 KiB or more is written into one array of the body's size plus
 * room for its headers. The bytes are the same as before (the journal's format does not
 * change), so a store written either way reads back either way.
 *
 * <p>KahaDBStore keeps its format in a final field without a setter; it is replaced when
 * the broker starts. If that fails (another ActiveMQ version), the broker keeps its own
 * format and says so in its log.
 */
public class SizedStorePlugin implements BrokerPlugin {

    private static final Logger LOG = LoggerFactory.getLogger(SizedStorePlugin.class);

    @Override
    public Broker installPlugin(Broker broker) throws IOException {
        PersistenceAdapter adapter = broker.getBrokerService().getPersistenceAdapter();
        if (!(adapter instanceof KahaDBPersistenceAdapter)) {
            return broker;
        }
        KahaDBStore store = ((KahaDBPersistenceAdapter) adapter).getStore();
        try {
            Field field = KahaDBStore.class.getDeclaredField("wireFormat");
            field.setAccessible(true);
            Object current = field.get(store);
            if (current instanceof OpenWireFormat) {
                field.set(store, new SizedFormat((OpenWireFormat) current));
                LOG.info("KahaDB marshals messages of {} bytes or more into one buffer of their size",
                         SizedFormat.LARGE);
            }
        } catch (ReflectiveOperationException | RuntimeException e) {
            LOG.warn("KahaDB keeps its own OpenWire format (messages are marshalled as ActiveMQ does): {}",
                     e.toString());
        }
        return broker;
    }

    /** KahaDB's OpenWire format (final, so wrapped), with large messages marshalled into one array. */
    static final class SizedFormat implements WireFormat {

        private static final int LARGE = 64 * 1024;
        // Headers, ids, destination and properties of one message; more only costs a regrowth.
        private static final int ROOM = 16 * 1024;

        private final OpenWireFormat format;

        SizedFormat(OpenWireFormat format) {
            this.format = format;
        }

        @Override
        public ByteSequence marshal(Object command) throws IOException {
            if (!(command instanceof Message) || format.isTightEncodingEnabled() || format.isCacheEnabled()
                    || format.isSizePrefixDisabled()) {
                return format.marshal(command);
            }
            Message message = (Message) command;
            ByteSequence content = message.getContent();
            if (content == null || content.getLength() < LARGE) {
                return format.marshal(command);
            }
            DataByteArrayOutputStream out = new DataByteArrayOutputStream(content.getLength() + ROOM);
            // [size: 4][type: 1][fields], as OpenWireFormat.marshal writes it. The nested form
            // writes a presence byte before the type: at offset 3, the size's last byte.
            out.position(3);
            synchronized (format) {
                format.looseMarshalNestedObject(message, out);
            }
            int end = out.size();
            out.position(0);
            out.writeInt(end - 4);
            out.position(end);
            return out.toByteSequence();
        }

        @Override
        public Object unmarshal(ByteSequence packet) throws IOException {
            return format.unmarshal(packet);
        }

        @Override
        public void marshal(Object command, DataOutput out) throws IOException {
            format.marshal(command, out);
        }

        @Override
        public Object unmarshal(DataInput in) throws IOException {
            return format.unmarshal(in);
        }

        @Override
        public void setVersion(int version) {
            format.setVersion(version);
        }

        @Override
        public int getVersion() {
            return format.getVersion();
        }
    }
}
